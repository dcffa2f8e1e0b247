"""The tutorial's ``build_cifar(batch_size)`` on :func:`kolossos.legacy.data.build_cifar`.

The tutorial's transforms (train: ``RandomCrop(224, pad_if_needed=True)``,
``AutoAugment(CIFAR10)``, ``ToTensor``, ``Normalize``; test: ``Resize(224)``, ``ToTensor``,
``Normalize``) at ``IMG_SIZE`` of the config instead of 224. AutoAugment needs torchvision: it is
applied when torchvision is installed, and skipped with a warning otherwise. CIFAR-10 is read
from ``$DATA`` (default ``./data``) when it is there (``download=True`` as the tutorial, when
``$DOWNLOAD_CIFAR`` is set); otherwise ``TRAIN_SIZE`` synthetic images stand in (a warning says
so).
"""

import importlib.util
import os

from kolossos.core import global_context as gpc
from kolossos.legacy.data import build_cifar as _build_cifar
from kolossos.logging import get_dist_logger


def build_cifar(batch_size):
    auto_augment = importlib.util.find_spec("torchvision") is not None
    if not auto_augment:
        get_dist_logger().warning(
            "AutoAugment(CIFAR10) needs torchvision, which is not installed: training without it",
            ranks=[0],
        )
    size = gpc.config.IMG_SIZE
    return _build_cifar(
        batch_size,
        root=os.environ.get("DATA", "./data"),
        padding=None,
        crop=size,
        resize=size,
        pad_if_needed=True,
        auto_augment=auto_augment,
        flip=False,
        download=bool(os.environ.get("DOWNLOAD_CIFAR")),
        synthetic_size=gpc.config.TRAIN_SIZE,
    )
