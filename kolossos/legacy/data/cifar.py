"""``build_cifar``: the CIFAR-10 train and test data loaders of Colossal-AI's tutorials (the
``titans.dataloader.cifar10.build_cifar`` they import, and the ViT tutorial's own version).

Images come from :class:`kolossos.datasets.CIFAR10`: the real data set under ``root`` (default
``$DATA``, else ``./data``) when its files are there (``download=True`` fetches it), otherwise a
deterministic synthetic stand-in of the same shape (with a warning). The transforms are written
with torch ops; only AutoAugment needs torchvision.

Example::

    # the ViT tutorial: RandomCrop(224, pad_if_needed=True), AutoAugment(CIFAR10), ToTensor,
    # Normalize; test: Resize(224), ToTensor, Normalize
    train, test = build_cifar(256, crop=224, resize=224, padding=None, pad_if_needed=True,
                              auto_augment=True, flip=False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD
from kolossos.datasets.transforms import normalize, random_horizontal_flip
from kolossos.legacy.utils import get_dataloader

__all__ = ["CifarTransform", "build_cifar"]


def _auto_augment() -> Any:
    try:
        from torchvision.transforms import AutoAugment, AutoAugmentPolicy
    except ImportError as err:
        raise ImportError(
            "build_cifar(auto_augment=True) needs torchvision (pip install torchvision); pass "
            "auto_augment=False to train without it."
        ) from err
    return AutoAugment(AutoAugmentPolicy.CIFAR10)


@dataclass(frozen=True, kw_only=True)
class CifarTransform:
    """One ``uint8 (3, H, W)`` image to a normalised float tensor, in torchvision's order:
    random crop (``crop`` pixels after zero-padding by ``padding``, or up to ``crop`` with
    ``pad_if_needed``), resize, AutoAugment, horizontal flip, ``ToTensor`` + ``Normalize``."""

    crop: int | None = None
    """Side of the random crop (``None``: no crop)."""
    padding: int | None = None
    """Zero padding on each side before the crop."""
    pad_if_needed: bool = False
    """Pad an image smaller than ``crop`` (after ``padding``) up to it, as torchvision does."""
    resize: int | None = None
    """Bilinear resize to ``resize x resize`` (``None``: keep)."""
    auto_augment: bool = False
    """torchvision's ``AutoAugment(AutoAugmentPolicy.CIFAR10)`` on the uint8 image."""
    flip: bool = False
    """Random horizontal flip with probability 0.5."""

    def __post_init__(self) -> None:
        for name in ("crop", "padding", "resize"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"CifarTransform: {name}={value!r} must be an int >= 0 or None.")
        if self.auto_augment:
            _auto_augment()  # fail now, not in a data-loader worker

    def _crop(self, image: torch.Tensor) -> torch.Tensor:
        if self.crop is None:
            return image
        pad = self.padding or 0
        image = F.pad(image, (pad, pad, pad, pad)) if pad else image
        height, width = image.shape[-2:]
        if self.pad_if_needed and (height < self.crop or width < self.crop):
            dh, dw = max(self.crop - height, 0), max(self.crop - width, 0)
            image = F.pad(image, (dw, dw, dh, dh))
            height, width = image.shape[-2:]
        if height < self.crop or width < self.crop:
            raise ValueError(
                f"CifarTransform: crop={self.crop} is larger than the {height}x{width} image; "
                "set pad_if_needed=True or padding."
            )
        top = int(torch.randint(0, height - self.crop + 1, (1,)))
        left = int(torch.randint(0, width - self.crop + 1, (1,)))
        return image[..., top : top + self.crop, left : left + self.crop]

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        image = self._crop(image)
        if self.resize is not None and tuple(image.shape[-2:]) != (self.resize, self.resize):
            size = (self.resize, self.resize)
            resized = F.interpolate(image[None].float(), size=size, mode="bilinear")[0]
            image = (
                resized.round().clamp(0, 255).to(image.dtype)
                if image.dtype == torch.uint8
                else resized
            )
        if self.auto_augment:
            image = _auto_augment()(image)
        out = image.float() / 255 if image.dtype == torch.uint8 else image.float()
        if self.flip:
            out = random_horizontal_flip(out)
        return normalize(out, CIFAR10_MEAN, CIFAR10_STD)


def build_cifar(
    batch_size: int,
    root: str | os.PathLike[str] | None = None,
    padding: int | None = 4,
    crop: int = 32,
    resize: int = 32,
    *,
    pad_if_needed: bool = False,
    auto_augment: bool = False,
    flip: bool = True,
    download: bool = False,
    synthetic_size: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = True,
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """The CIFAR-10 train and test loaders (``kolossos.utils.get_dataloader``: the train loader
    shuffles and takes this data-parallel rank's share, the test loader is the whole set).

    Train: crop ``crop`` after ``padding`` (``pad_if_needed``), resize to ``resize``, optional
    AutoAugment, ``flip``, normalise with CIFAR-10's mean and std. Test: resize and normalise.

    Args:
        batch_size: per-process batch size.
        root: the data directory (default ``$DATA``, else ``./data``).
        padding, crop, resize: titans' arguments (``padding=None``: no padding).
        pad_if_needed, auto_augment, flip: the ViT tutorial's ``RandomCrop(224,
            pad_if_needed=True)`` / ``AutoAugment(CIFAR10)``; titans' ``RandomHorizontalFlip``.
        download: fetch CIFAR-10 when it is missing.
        synthetic_size: samples of the synthetic stand-in when the data set is absent (test set:
            a quarter of it, at least one batch).
        num_workers, pin_memory: the loaders' (``pin_memory`` is ignored without a GPU).

    Raises:
        ImportError: ``auto_augment=True`` without torchvision.

    Example:
        >>> train, test = build_cifar(4, root="/nonexistent", synthetic_size=8)  # doctest: +SKIP
    """
    base = Path(root if root is not None else os.environ.get("DATA", "./data"))
    train_tf = CifarTransform(
        crop=crop, padding=padding, pad_if_needed=pad_if_needed, resize=resize,
        auto_augment=auto_augment, flip=flip,
    )  # fmt: skip
    test_tf = CifarTransform(resize=resize)
    test_size = None if synthetic_size is None else max(synthetic_size // 4, batch_size)
    train = CIFAR10(base, True, train_tf, download=download, synthetic_size=synthetic_size)
    test = CIFAR10(base, False, test_tf, synthetic_size=test_size)
    memory = pin_memory and torch.cuda.is_available()
    common = dict(batch_size=batch_size, num_workers=num_workers, pin_memory=memory)
    train_loader = get_dataloader(train, shuffle=True, **common)  # type: ignore[arg-type]
    test_loader = get_dataloader(test, add_sampler=False, **common)  # type: ignore[arg-type]
    return train_loader, test_loader
