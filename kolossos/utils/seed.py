"""Seeding every random number generator a training run touches."""

from __future__ import annotations

import random

import torch

from kolossos.accelerator import get_accelerator


def set_seed(seed: int) -> None:
    """Seed python's ``random``, numpy (if installed), torch's CPU generator and the accelerator's.

    Args:
        seed: a non-negative integer.

    Raises:
        ValueError: a negative or non-integer seed.

    Example:
        >>> set_seed(1024)
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer, e.g. 1024.")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional at run time
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    accelerator = get_accelerator()
    if accelerator.name != "cpu":
        accelerator.manual_seed_all(seed)
