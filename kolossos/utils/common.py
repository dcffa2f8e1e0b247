"""Small helpers the documented scripts import from ``kolossos.utils``."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kolossos.accelerator import get_accelerator


def get_current_device() -> torch.device:
    """The device this process computes on: ``cuda:<local rank>`` with CUDA, else ``cpu``."""
    return get_accelerator().get_current_device()


def print_rank_0(msg: str, logger: logging.Logger | None = None) -> None:
    """Print ``msg`` (or log it with ``logger.info``) on global rank 0 only.

    Example:
        >>> print_rank_0("hello")
        hello
    """
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if logger is None:
        print(msg, flush=True)
    else:
        logger.info(msg)
