"""CIFAR-10 as a Dataset: the real "python version" files, or a synthetic stand-in when absent.

When the data is not found (and not downloaded), a
:class:`~kolossos.datasets.synthetic.SyntheticImageDataset` of the same shape stands in and one
warning says so; the files themselves are handled by :mod:`kolossos.datasets.cifar10_io`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from kolossos.datasets.cifar10_io import (
    BATCH_DIR,
    CLASSES,
    TEST_FILES,
    TRAIN_FILES,
    download_cifar10,
    find_cifar10,
    load_cifar10_batch,
)
from kolossos.datasets.synthetic import SyntheticImageDataset
from kolossos.datasets.transforms import ImageTransform

__all__ = ["CIFAR10", "CIFAR10_MEAN", "CIFAR10_STD", "get_cifar10"]

_logger = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the training images, the values used by the Colossal-AI tutorials."""
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
"""Per-channel standard deviation, as used by the Colossal-AI tutorials."""
_HINT = (
    "Point root= or the DATA environment variable at a directory holding "
    f"'{BATCH_DIR}/' (the 'CIFAR-10 python version' from https://www.cs.toronto.edu/~kriz/"
    "cifar.html), or pass download=True on a machine with internet access."
)
_warned: list[bool] = []  # the synthetic-data warning is logged once per process


class CIFAR10(Dataset[tuple[Any, Any]]):
    """CIFAR-10 images as ``(3, 32, 32)`` uint8 tensors with int labels, real or synthetic.

    The data is looked up under ``root`` (or the ``DATA`` environment variable when ``root`` is
    None), either as ``<root>/cifar-10-batches-py/`` or as ``<root>`` itself. If it is missing and
    ``download`` is set, the official archive is fetched into ``root`` (``./data`` by default). If
    there is still no data, a deterministic, learnable synthetic stand-in of the same shape
    (``synthetic_size`` samples, by default 50,000 train / 10,000 test) is used and one warning
    is logged; ``allow_synthetic=False`` makes that an error instead. :attr:`is_synthetic` tells
    which one you got. Images are tensors (torchvision's ``ToTensor`` expects PIL images: use
    :func:`kolossos.datasets.get_cifar10`, or ``transforms.v2`` ops that accept tensors).

    Args:
        root: directory holding the data; ``None`` reads ``$DATA``.
        train: the 50,000 training images, or the 10,000 test images.
        transform: applied to each ``(3, 32, 32)`` uint8 image tensor.
        target_transform: applied to each int label.
        download: fetch the official archive when the data is missing.
        synthetic_size: number of samples of the synthetic fallback (unused for real data).
        allow_synthetic: fall back to synthetic data; if False, missing data raises.
        seed: seed of the synthetic fallback (train and test share its class patterns).

    Raises:
        FileNotFoundError: no data was found and ``allow_synthetic`` is False.
        UnsafePickleError: a batch file tries to load anything but containers and numpy arrays.

    Example:
        >>> ds = CIFAR10(root="/nonexistent", train=False, synthetic_size=16)
        >>> ds.is_synthetic, len(ds), ds[0][0].shape
        (True, 16, torch.Size([3, 32, 32]))
    """

    classes = CLASSES

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        train: bool = True,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        download: bool = False,
        *,
        synthetic_size: int | None = None,
        allow_synthetic: bool = True,
        seed: int = 0,
    ) -> None:
        self.train, self.transform, self.target_transform = train, transform, target_transform
        found, problem = find_cifar10(root), ""
        if found is None and download:
            target = root if root is not None else os.environ.get("DATA", "./data")
            try:
                found = download_cifar10(target)
            except (OSError, ValueError) as error:
                problem = f" Downloading into {target} failed: {error}."
        self.root = found
        self._synthetic: SyntheticImageDataset | None = None
        if found is not None:
            parts = [load_cifar10_batch(found / n) for n in (TRAIN_FILES if train else TEST_FILES)]
            self.data = torch.cat([images for images, _ in parts])
            self.targets = [label for _, labels in parts for label in labels]
            return
        where = root if root is not None else os.environ.get("DATA", "<unset DATA variable>")
        message = f"CIFAR-10 not found under {where}.{problem} {_HINT}"
        if not allow_synthetic:
            raise FileNotFoundError(message)
        size = synthetic_size if synthetic_size is not None else (50_000 if train else 10_000)
        # Train and test share the class patterns (same seed) but not their samples (offset).
        offset = 0 if train else 2**31
        self._synthetic = SyntheticImageDataset(size, (3, 32, 32), 10, seed, index_offset=offset)
        self.targets = list(self._synthetic.labels)
        if not _warned:
            _warned.append(True)
            note = "losses fall, but accuracies say nothing about CIFAR-10"
            _logger.warning(
                "%s Using SYNTHETIC data (%d samples, seed %d): %s.", message, size, seed, note
            )

    @property
    def is_synthetic(self) -> bool:
        """Whether this dataset is the synthetic stand-in rather than the real CIFAR-10."""
        return self._synthetic is not None

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if self._synthetic is not None:
            image, label = self._synthetic[index]
        else:
            image, label = self.data[index], self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label


def get_cifar10(
    root: str | os.PathLike[str] | None = None,
    train: bool = True,
    normalize: bool = True,
    augment: bool = False,
    synthetic_size: int | None = None,
    *,
    download: bool = False,
    allow_synthetic: bool = True,
    seed: int = 0,
) -> CIFAR10:
    """CIFAR-10 (or its synthetic stand-in) yielding float32 ``(3, 32, 32)`` tensors and int labels.

    Args:
        root: directory holding ``cifar-10-batches-py/``; ``None`` reads ``$DATA``.
        train: the training split, or the test split.
        normalize: standardise with :data:`CIFAR10_MEAN` / :data:`CIFAR10_STD`; otherwise values
            are in [0, 1].
        augment: random crop (4-pixel zero padding) and horizontal flip, drawn from torch's RNG.
        synthetic_size: samples of the synthetic fallback (default 50,000 / 10,000).
        download: fetch the official archive when the data is missing (see :class:`CIFAR10`).
        allow_synthetic: fall back to synthetic data when the real data is missing.
        seed: seed of the synthetic fallback.

    Example:
        >>> ds = get_cifar10(root="/nonexistent", synthetic_size=8, augment=True)
        >>> image, label = ds[0]
        >>> image.dtype, image.shape
        (torch.float32, torch.Size([3, 32, 32]))
    """
    transform = ImageTransform(
        CIFAR10_MEAN if normalize else None,
        CIFAR10_STD if normalize else None,
        crop_padding=4 if augment else 0,
        flip=augment,
    )
    return CIFAR10(
        root,
        train,
        transform,
        download=download,
        synthetic_size=synthetic_size,
        allow_synthetic=allow_synthetic,
        seed=seed,
    )
