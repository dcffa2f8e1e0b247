"""The expert-parallel exchange: ``all_to_all_single`` with uneven splits, differentiable.

Rank ``i`` sends ``input_splits[j]`` rows to rank ``j`` and receives ``output_splits[j]`` rows
from it; the backward pass sends the gradients back the same way (splits swapped). gloo and
NCCL both run ``all_to_all_single`` with uneven splits (ENVIRONMENT.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_to_all_uneven", "exchange_counts"]


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    # SYNC POINT: every rank of the expert-parallel group
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_uneven(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Exchange the rows of ``x`` (``in_splits[j]`` of them for rank ``j``, in rank order) and
    return what the ranks sent here (``out_splits[j]`` rows from rank ``j``). Differentiable.
    ``group=None``: one rank, ``x`` is returned.

    COLLECTIVE over ``group`` (forward and backward).
    """
    if group is None:
        return x
    out: torch.Tensor = _AllToAll.apply(x, out_splits, in_splits, group)
    return out


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``counts[E]`` (rows this rank sends to each expert; experts in rank blocks) → ``[ep,
    E_local]``: how many rows each rank sends to each of this rank's experts.

    COLLECTIVE over ``group``.
    """
    if group is None:
        return counts.reshape(1, -1)
    size = dist.get_world_size(group)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)  # SYNC POINT
    return out.reshape(size, -1)
