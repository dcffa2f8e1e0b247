"""Questions about the launch's parallel layout, answered from the global context (``gpc``):
``is_using_pp()`` and friends of Colossal-AI's ``colossalai.utils``.

Before a launch (or without the mode in the ``parallel`` config) a mode counts as unused.

Example:
    >>> is_using_pp()  # no launch: no pipeline
    False
"""

from __future__ import annotations

from collections.abc import Hashable

from kolossos.legacy.context.parallel_context import global_context as gpc
from kolossos.legacy.context.parallel_mode import ParallelMode

__all__ = [
    "is_dp_rank_0",
    "is_no_pp_or_last_stage",
    "is_tp_rank_0",
    "is_using_ddp",
    "is_using_pp",
    "is_using_sequence",
]


def _size(mode: Hashable) -> int:
    return gpc.get_world_size(mode) if gpc.is_initialized(mode) else 1


def is_using_ddp() -> bool:
    """Whether the DATA group has more than one rank (gradients are all-reduced over it)."""
    return _size(ParallelMode.DATA) > 1


def is_using_pp() -> bool:
    """Whether the launch config asked for more than one pipeline stage."""
    return _size(ParallelMode.PIPELINE) > 1


def is_using_sequence() -> bool:
    """Whether the launch config asked for sequence parallelism over more than one rank."""
    return _size(ParallelMode.SEQUENCE) > 1


def is_dp_rank_0() -> bool:
    """Whether this rank is the first of its DATA group (True without one)."""
    return not gpc.is_initialized(ParallelMode.DATA) or gpc.is_first_rank(ParallelMode.DATA)


def is_tp_rank_0() -> bool:
    """Whether this rank is the first of its TENSOR group (True without one)."""
    return not gpc.is_initialized(ParallelMode.TENSOR) or gpc.is_first_rank(ParallelMode.TENSOR)


def is_no_pp_or_last_stage() -> bool:
    """Whether there is no pipeline or this rank is its last stage (where the loss is)."""
    return not gpc.is_initialized(ParallelMode.PIPELINE) or gpc.is_last_rank(ParallelMode.PIPELINE)
