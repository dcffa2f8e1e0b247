"""Utilities the documented scripts import: devices, seeding, rank-0 printing, checkpoints."""

from kolossos.utils.checkpoint import load_checkpoint, save_checkpoint
from kolossos.utils.common import get_current_device, print_rank_0
from kolossos.utils.seed import set_seed

__all__ = [
    "get_current_device",
    "load_checkpoint",
    "print_rank_0",
    "save_checkpoint",
    "set_seed",
]
