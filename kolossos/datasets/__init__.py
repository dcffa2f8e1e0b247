"""Datasets for tutorials, tests and benchmarks: CIFAR-10 (real or synthetic) and synthetic data.

Example:
    >>> from kolossos.datasets import get_cifar10
    >>> train = get_cifar10(root="/nonexistent", train=True, augment=True, synthetic_size=64)
    >>> train[0][0].shape
    torch.Size([3, 32, 32])
"""

from kolossos.datasets.cifar10 import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, get_cifar10
from kolossos.datasets.cifar10_io import (
    UnsafePickleError,
    download_cifar10,
    find_cifar10,
    load_cifar10_batch,
)
from kolossos.datasets.synthetic import SyntheticImageDataset, SyntheticTokenDataset
from kolossos.datasets.transforms import ImageTransform

__all__ = [
    "CIFAR10",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "ImageTransform",
    "SyntheticImageDataset",
    "SyntheticTokenDataset",
    "UnsafePickleError",
    "download_cifar10",
    "find_cifar10",
    "get_cifar10",
    "load_cifar10_batch",
]
