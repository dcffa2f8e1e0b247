"""Colossal-AI's legacy ``colossalai.utils`` helpers that read the global context:
``get_dataloader`` (sharded over the DATA group), ``is_using_pp`` and friends — plus the
utilities of :mod:`kolossos.utils` the legacy scripts import from the same place (timers,
rank-0 printing, the current device, the checkpoint pair).

``kolossos.utils.get_dataloader``, ``kolossos.utils.is_using_pp`` ... resolve here lazily.

Example:
    >>> from kolossos.legacy.utils import MultiTimer, get_dataloader, is_using_pp
    >>> is_using_pp()
    False
"""

from kolossos.legacy.utils.checkpoint import load_checkpoint, save_checkpoint
from kolossos.legacy.utils.data_sampler import DataParallelSampler, get_dataloader
from kolossos.legacy.utils.parallel_state import (
    is_dp_rank_0,
    is_no_pp_or_last_stage,
    is_tp_rank_0,
    is_using_ddp,
    is_using_pp,
    is_using_sequence,
)
from kolossos.utils import conditional_context, get_current_device, print_rank_0
from kolossos.utils.timer import MultiTimer, Timer

__all__ = [
    "DataParallelSampler",
    "MultiTimer",
    "Timer",
    "conditional_context",
    "get_current_device",
    "get_dataloader",
    "is_dp_rank_0",
    "is_no_pp_or_last_stage",
    "is_tp_rank_0",
    "is_using_ddp",
    "is_using_pp",
    "is_using_sequence",
    "load_checkpoint",
    "print_rank_0",
    "save_checkpoint",
]
