"""Utilities the documented scripts import: devices, seeding, rank-0 printing, timers,
checkpoints, activation checkpointing (``checkpoint``), ``conditional_context``, and the legacy
data loader.

``save_checkpoint`` / ``load_checkpoint`` live in :mod:`kolossos.legacy.utils.checkpoint`,
``get_dataloader``, ``DataParallelSampler`` and ``is_using_pp`` / ``is_using_ddp`` /
``is_using_sequence`` in :mod:`kolossos.legacy.utils` (they read the global context); all are
resolved lazily here, so importing a utility (e.g. :mod:`kolossos.utils.seed`) loads neither
checkpoint IO nor the legacy API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes
from kolossos.utils.common import get_current_device, print_rank_0
from kolossos.utils.context import conditional_context
from kolossos.utils.multi_tensor_apply import multi_tensor_applier
from kolossos.utils.seed import set_seed
from kolossos.utils.timer import MultiTimer, Timer

if TYPE_CHECKING:
    from kolossos.legacy.utils import (
        DataParallelSampler,
        get_dataloader,
        is_using_ddp,
        is_using_pp,
        is_using_sequence,
    )
    from kolossos.legacy.utils.checkpoint import load_checkpoint, save_checkpoint
    from kolossos.utils.activation_checkpoint import checkpoint

_CHECKPOINT = "kolossos.legacy.utils.checkpoint"
_LEGACY_UTILS = "kolossos.legacy.utils"
_LAZY = {
    "checkpoint": ("kolossos.utils.activation_checkpoint", "checkpoint"),
    "load_checkpoint": (_CHECKPOINT, "load_checkpoint"),
    "save_checkpoint": (_CHECKPOINT, "save_checkpoint"),
    **{
        name: (_LEGACY_UTILS, name)
        for name in (
            "DataParallelSampler",
            "get_dataloader",
            "is_using_ddp",
            "is_using_pp",
            "is_using_sequence",
        )
    },
}

__all__ = [
    "DataParallelSampler",
    "MultiTimer",
    "Timer",
    "checkpoint",
    "conditional_context",
    "get_current_device",
    "get_dataloader",
    "is_using_ddp",
    "is_using_pp",
    "is_using_sequence",
    "load_checkpoint",
    "multi_tensor_applier",
    "print_rank_0",
    "save_checkpoint",
    "set_seed",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
