"""Helpers shared by the trainer hooks: number formatting, reductions over the DATA group and
the rank questions the logging hooks ask."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kolossos.accelerator import get_accelerator
from kolossos.legacy.context.parallel_context import global_context as gpc
from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.utils.parallel_state import (
    is_dp_rank_0,
    is_no_pp_or_last_stage,
    is_tp_rank_0,
)

__all__ = [
    "data_parallel_size",
    "format_number",
    "is_rank_to_log",
    "metric_tensor",
    "reduce_over_data",
]


def format_number(value: Any, precision: int = 5) -> Any:
    """A float (or floating-point tensor) as ``precision`` significant digits; other values as
    they are.

    Example:
        >>> format_number(3.14159265, 3)
        '3.14'
    """
    if isinstance(value, float):
        return f"{value:.{precision}g}"
    if torch.is_tensor(value) and torch.is_floating_point(value):
        return f"{value.item():.{precision}g}"
    return value


def metric_tensor(value: float = 0.0) -> torch.Tensor:
    """A one-element float64 accumulator on the accelerator's current device (the device the
    DATA group's backend communicates on)."""
    return torch.full(
        (1,), value, dtype=torch.float64, device=get_accelerator().get_current_device()
    )


def data_parallel_size() -> int:
    """The size of the global context's DATA group (1 before a launch)."""
    return gpc.get_world_size(ParallelMode.DATA) if gpc.is_initialized(ParallelMode.DATA) else 1


def reduce_over_data(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over the DATA group, as a new tensor (``tensor`` is left alone, so
    reading a metric twice gives the same value). COLLECTIVE over the DATA group when it has
    more than one rank: every rank of the group must call it."""
    result = tensor.detach().clone()
    if data_parallel_size() > 1:
        dist.all_reduce(result, op=dist.ReduceOp.SUM, group=gpc.get_group(ParallelMode.DATA))
    return result


def is_rank_to_log(need_last_stage: bool = True) -> bool:
    """Whether this rank writes the logs: the first rank of its DATA and TENSOR groups (and the
    last pipeline stage, where the loss is, when ``need_last_stage``)."""
    ok = is_dp_rank_0() and is_tp_rank_0()
    return ok and (is_no_pp_or_last_stage() if need_last_stage else True)
