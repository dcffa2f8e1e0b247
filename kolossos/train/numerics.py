"""The numerics guard of ``kolossos train``: find non-finite values and say where they are.

A non-finite loss (or a non-finite tensor about to be checkpointed) is decided by every rank
together (one all-reduce), then each rank names the first non-finite tensor it holds: a model
parameter by name, else an optimizer tensor (master copy or state) by its group, position and
state key. fp16 overflows are not seen here: their loss is finite and the optimizer skips the
step and lowers the loss scale, as always.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from kolossos.checkpoint_io.param_names import unwrap_optimizer
from kolossos.interface import unwrap_model

__all__ = [
    "NonFiniteError",
    "any_rank",
    "first_nonfinite",
    "gather_offenders",
    "is_finite",
    "local_tensors",
]


class NonFiniteError(RuntimeError):
    """Training produced non-finite values; every rank raises it at the same step."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def is_finite(value: float) -> bool:
    """Whether a Python number is finite."""
    return math.isfinite(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds (a ``DTensor``'s local shard)."""
    to_local = getattr(tensor, "to_local", None)  # DTensor (FSDP2, tensor parallel styles)
    return to_local() if callable(to_local) else tensor


def local_tensors(model: torch.nn.Module, optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(description, tensor)`` for every floating tensor this rank holds of the model's
    parameters and the optimizer's tensors (the master copies it steps and its states)."""
    for name, param in unwrap_model(model).named_parameters():
        yield name, _local(param.detach())
    optim = unwrap_optimizer(optimizer)
    for g, group in enumerate(optim.param_groups):
        for i, param in enumerate(group["params"]):
            where = f"optimizer param_groups[{g}].params[{i}]"
            yield where, _local(param.detach())
            for key, value in optim.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    yield f"{where} state {key!r}", _local(value)


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The description of the first tensor holding inf or NaN, or ``None``."""
    for name, tensor in tensors:
        if tensor.numel() and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def gather_offenders(offender: str | None) -> list[tuple[int, str]]:
    """Every rank's first non-finite tensor, as ``(rank, description)`` (a collective)."""
    if not dist.is_initialized():
        return [] if offender is None else [(0, offender)]
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, offender)  # SYNC POINT
    return [(rank, name) for rank, name in enumerate(found) if name is not None]


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (a collective)."""
    from kolossos.cluster.collectives import comm_device

    value = torch.tensor([float(flag)], dtype=torch.float64, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)  # SYNC POINT
    return bool(value.item() > 0)
