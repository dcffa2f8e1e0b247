"""Autograd collectives of 1D tensor parallelism (Megatron's f/g operators and their sequence-
parallel counterparts).

Each function is a collective over ``group`` in its forward and/or backward pass: every rank of the
group must run the same forward and backward. Tensors are always communicated through flat
contiguous buffers (gloo cannot gather into a stacked 2-D output).

=================================  =========================  ==========================
function                           forward                    backward
=================================  =========================  ==========================
:func:`copy_to_tp`                 identity                   all-reduce
:func:`reduce_from_tp`             all-reduce                 identity
:func:`gather_from_tp`             all-gather along ``dim``   keep own slice
:func:`split_to_tp`                keep own slice             all-gather along ``dim``
:func:`gather_seq_reduce_scatter_grad`  all-gather along ``dim``  reduce-scatter along ``dim``
:func:`reduce_scatter_seq_gather_grad`  reduce-scatter along ``dim``  all-gather along ``dim``
=================================  =========================  ==========================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "all_gather_along",
    "all_gather_flat",
    "all_reduce",
    "copy_to_tp",
    "gather_from_tp",
    "gather_seq_reduce_scatter_grad",
    "reduce_from_tp",
    "reduce_scatter_along",
    "reduce_scatter_flat",
    "reduce_scatter_seq_gather_grad",
    "split_along",
    "split_to_tp",
]


def all_gather_flat(output: torch.Tensor, local: torch.Tensor, group: ProcessGroup) -> None:
    """Gather every rank's flat ``local`` into the flat ``output`` (rank order). torch 2.13 renames
    ``all_gather_into_tensor`` to ``all_gather_single``; older releases only have the former."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)  # SYNC POINT


def reduce_scatter_flat(output: torch.Tensor, flat_in: torch.Tensor, group: ProcessGroup) -> None:
    """Sum the flat ``flat_in`` over ``group`` and keep this rank's equal slice in ``output``
    (``reduce_scatter_single`` on torch 2.13+, ``reduce_scatter_tensor`` before)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, flat_in, group=group)  # SYNC POINT


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> None:
    if x.shape[dim] % world:
        raise ValueError(
            f"{what}: dimension {dim} of the tensor of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by the tensor-parallel size {world}; pad it (e.g. the "
            "sequence length under sequence parallelism) to a multiple of the group size."
        )


def all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over ``group`` in a new tensor (``x`` is left untouched)."""
    out = x.contiguous().clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)  # SYNC POINT
    return out


def all_gather_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenation along ``dim`` of ``x`` from every rank of ``group``, in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    local = x.contiguous()
    flat = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather_flat(flat, local.view(-1), group)
    return torch.cat(flat.view(world, *local.shape).unbind(0), dim=dim)


def split_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (no communication)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "split_along")
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def reduce_scatter_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of ``x`` over ``group``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "reduce_scatter_along")
    chunks = x.chunk(world, dim=dim)
    flat_in = torch.cat([chunk.contiguous().view(-1) for chunk in chunks])
    out = torch.empty(chunks[0].numel(), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, flat_in, group)
    return out.view(chunks[0].shape)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


AlongDim = Callable[[torch.Tensor, int, ProcessGroup], torch.Tensor]


class _AlongDim(torch.autograd.Function):
    """A collective along ``dim`` forward and its adjoint backward: gather / split, gather /
    reduce-scatter (the four dimension-wise pairs of Megatron TP and SP share this)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, fwd: AlongDim, bwd: AlongDim
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.bwd = dim, group, bwd
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.bwd(grad, ctx.dim, ctx.group), None, None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity forward, gradient summed
    over ``group`` backward (Megatron's *f*)."""
    out: torch.Tensor = _CopyToTP.apply(x, group)
    return out


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leave a tensor-parallel region: partial results summed over ``group`` forward, identity
    backward (Megatron's *g*)."""
    out: torch.Tensor = _ReduceFromTP.apply(x, group)
    return out


def gather_from_tp(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' slices along ``dim`` forward; keep this rank's slice backward."""
    out: torch.Tensor = _AlongDim.apply(x, dim % x.dim(), group, all_gather_along, split_along)
    return out


def split_to_tp(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along ``dim`` forward; concatenate the gradients backward."""
    out: torch.Tensor = _AlongDim.apply(x, dim % x.dim(), group, split_along, all_gather_along)
    return out


def gather_seq_reduce_scatter_grad(
    x: torch.Tensor, group: ProcessGroup, dim: int = 1
) -> torch.Tensor:
    """Sequence-parallel entry: all-gather the sequence shards along ``dim`` forward; the gradient
    of the full sequence is summed over ``group`` and scattered back along ``dim``."""
    out: torch.Tensor = _AlongDim.apply(
        x, dim % x.dim(), group, all_gather_along, reduce_scatter_along
    )
    return out


def reduce_scatter_seq_gather_grad(
    x: torch.Tensor, group: ProcessGroup, dim: int = 1
) -> torch.Tensor:
    """Sequence-parallel exit: partial results summed over ``group`` and scattered along ``dim``
    forward; the shards' gradients are all-gathered along ``dim`` backward."""
    _check_divisible(x, dim, dist.get_world_size(group), "reduce_scatter_seq_gather_grad")
    out: torch.Tensor = _AlongDim.apply(
        x, dim % x.dim(), group, reduce_scatter_along, all_gather_along
    )
    return out
