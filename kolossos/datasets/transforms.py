"""Image transforms written with torch ops (torchvision is optional): crop, flip, normalise.

They take and return ``(C, H, W)`` tensors, draw randomness from torch's RNG (the global one unless
a generator is given, so DataLoader workers get their own seeds), and pickle cleanly for workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["ImageTransform", "normalize", "random_crop", "random_horizontal_flip"]


def random_crop(
    image: torch.Tensor, padding: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Zero-pad each side by ``padding`` pixels and cut a random window of the original size.

    Example:
        >>> random_crop(torch.ones(3, 32, 32), padding=4).shape
        torch.Size([3, 32, 32])
    """
    if padding <= 0:
        return image
    height, width = image.shape[-2:]
    padded = F.pad(image, (padding, padding, padding, padding))
    top, left = torch.randint(0, 2 * padding + 1, (2,), generator=generator).tolist()
    return padded[..., top : top + height, left : left + width]


def random_horizontal_flip(
    image: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Mirror the image left-right with probability ``p``.

    Example:
        >>> random_horizontal_flip(torch.arange(3.0).view(1, 1, 3), p=1.0).flatten().tolist()
        [2.0, 1.0, 0.0]
    """
    if torch.rand((), generator=generator).item() < p:
        return image.flip(-1)
    return image


def normalize(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(image - mean) / std`` per channel, for a float ``(C, H, W)`` image.

    Example:
        >>> normalize(torch.ones(2, 1, 1), (0.5, 0.0), (0.5, 2.0)).flatten().tolist()
        [1.0, 0.5]
    """
    m = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image - m) / s


class ImageTransform:
    """uint8 (or float) image to float32 in [0, 1], then optional augmentation and normalisation.

    Args:
        mean: per-channel mean to subtract (with ``std``); ``None`` skips normalisation.
        std: per-channel standard deviation to divide by.
        crop_padding: if > 0, random crop after zero-padding by this many pixels (before
            normalisation, so the padding is black as in the usual CIFAR recipe).
        flip: random horizontal flip with probability 0.5.

    Raises:
        ValueError: only one of ``mean`` and ``std`` is given, or their lengths differ.

    Example:
        >>> t = ImageTransform(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_padding=4, flip=True)
        >>> out = t(torch.zeros(3, 32, 32, dtype=torch.uint8))
        >>> out.dtype, out.shape, out.min().item()
        (torch.float32, torch.Size([3, 32, 32]), -1.0)
    """

    def __init__(
        self,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        *,
        crop_padding: int = 0,
        flip: bool = False,
    ) -> None:
        if (mean is None) != (std is None) or (mean is not None and len(mean) != len(std or ())):
            raise ValueError(f"mean={mean} and std={std} must be given together, of equal length.")
        if crop_padding < 0:
            raise ValueError(f"crop_padding={crop_padding} must be >= 0.")
        self.mean = tuple(mean) if mean is not None else None
        self.std = tuple(std) if std is not None else None
        self.crop_padding, self.flip = crop_padding, flip

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """Apply the transform to one ``(C, H, W)`` image."""
        out = image.float() / 255 if image.dtype == torch.uint8 else image.float()
        out = random_crop(out, self.crop_padding)
        if self.flip:
            out = random_horizontal_flip(out)
        if self.mean is not None and self.std is not None:
            out = normalize(out, self.mean, self.std)
        return out

    def __repr__(self) -> str:
        return (
            f"ImageTransform(mean={self.mean}, std={self.std}, "
            f"crop_padding={self.crop_padding}, flip={self.flip})"
        )
