"""Utilities the documented scripts import: devices, seeding, rank-0 printing."""

from kolossos.utils.common import get_current_device, print_rank_0
from kolossos.utils.seed import set_seed

__all__ = ["get_current_device", "print_rank_0", "set_seed"]
