"""Utilities the documented scripts import: devices, seeding, rank-0 printing, checkpoints,
``conditional_context``.

``save_checkpoint`` / ``load_checkpoint`` live in :mod:`kolossos.checkpoint_io.legacy_checkpoint`
and are resolved lazily here, so importing a utility (e.g. :mod:`kolossos.utils.seed`) does not
load checkpoint IO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes
from kolossos.utils.common import get_current_device, print_rank_0
from kolossos.utils.context import conditional_context
from kolossos.utils.multi_tensor_apply import multi_tensor_applier
from kolossos.utils.seed import set_seed

if TYPE_CHECKING:
    from kolossos.checkpoint_io.legacy_checkpoint import load_checkpoint, save_checkpoint

_CHECKPOINT = "kolossos.checkpoint_io.legacy_checkpoint"
_LAZY = {
    "load_checkpoint": (_CHECKPOINT, "load_checkpoint"),
    "save_checkpoint": (_CHECKPOINT, "save_checkpoint"),
}

__all__ = [
    "conditional_context",
    "get_current_device",
    "load_checkpoint",
    "multi_tensor_applier",
    "print_rank_0",
    "save_checkpoint",
    "set_seed",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
