"""Autograd collectives of 2D tensor parallelism besides the SUMMA products.

=================================  ===================================  ==========================
function                           forward                              backward
=================================  ===================================  ==========================
:func:`gather_weight_2d`           all-gather along ``dim`` (a group)   reduce-scatter along ``dim``
:func:`reduce_scatter_2d`          reduce-scatter along ``dim``         all-gather along ``dim``
:func:`split_batch_2d`             keep batch block ``i`` (local)       (local)
:func:`reduce_by_batch_2d`         all-reduce over the column group     identity (or ``/ q``)
=================================  ===================================  ==========================

A block of a weight that the ranks of one grid column share (a bias, a LayerNorm scale, a
classifier weight) is all-gathered over the column group before use; its gradient, a partial sum
over this rank's batch block, is summed over the column group (the batch blocks) and scattered
back — the pair :func:`gather_weight_2d` implements.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kolossos.nn.layer.parallel_1d._comm import (
    gather_seq_reduce_scatter_grad,
    reduce_scatter_seq_gather_grad,
)
from kolossos.nn.layer.parallel_2d.grid import Groups2D

__all__ = [
    "gather_weight_2d",
    "reduce_by_batch_2d",
    "reduce_scatter_2d",
    "split_batch_2d",
]


def gather_weight_2d(x: torch.Tensor, groups: Groups2D, dim: int = 0) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` over the column group; backward: the gradient is summed
    over the column group and this rank's slice kept (reduce-scatter). COLLECTIVE."""
    return gather_seq_reduce_scatter_grad(x, groups.col, dim)


def reduce_scatter_2d(x: torch.Tensor, groups: Groups2D, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the column group and keep block ``i`` along ``dim``; backward: all-gather
    along ``dim``. COLLECTIVE over the column group.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by ``q``.
    """
    return reduce_scatter_seq_gather_grad(x, groups.col, dim)


def split_batch_2d(x: torch.Tensor, groups: Groups2D, dim: int = 0) -> torch.Tensor:
    """This rank's batch block: ``chunk(x, q, dim)[i]`` with ``i`` its grid row (its rank in the
    column group), as Colossal-AI's ``split_batch_2d``. No communication.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by ``q``.

    Example:
        >>> x_ij = split_batch_2d(x, groups)  # [B, ...] -> [B/q, ...]  # doctest: +SKIP
    """
    if groups.q == 1:
        return x
    if x.shape[dim] % groups.q:
        raise ValueError(
            f"split_batch_2d: dimension {dim} of the tensor of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by q={groups.q}; use a batch size that is a multiple "
            f"of {groups.q}."
        )
    return x.chunk(groups.q, dim=dim)[groups.row_index].contiguous()


class _ReduceByBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Groups2D, mean: bool) -> torch.Tensor:
        ctx.scale = 1.0 / groups.q if mean else 1.0
        out = x.detach().contiguous().clone()
        if groups.q > 1:
            dist.all_reduce(out, group=groups.col)  # SYNC POINT: the batch blocks
        return out * ctx.scale if mean else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None, None


def reduce_by_batch_2d(
    x: torch.Tensor, groups: Groups2D, reduce_mean: bool = False
) -> torch.Tensor:
    """Sum (or, with ``reduce_mean``, average) a per-batch-block value over the column group
    (the ``q`` batch blocks), as Colossal-AI's ``reduce_by_batch_2d``. Every rank then holds the
    value of the whole batch. Backward passes the gradient through (divided by ``q`` for the
    mean), since every rank computes the same total. COLLECTIVE over the column group.

    Example:
        >>> loss = reduce_by_batch_2d(local_mean_loss, groups, reduce_mean=True)  # doctest: +SKIP
    """
    out: torch.Tensor = _ReduceByBatch.apply(x, groups, reduce_mean)
    return out
