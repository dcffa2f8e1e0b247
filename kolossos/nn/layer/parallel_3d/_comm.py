"""Autograd collectives and the 3D matrix product.

==============================  ===============================  ==============================
function                        forward                          backward
==============================  ===============================  ==============================
:func:`linear_3d`               all-gather X (input group) and   all-gather dY (output group);
                                A (weight group); X A;           reduce-scatter dX (input) and
                                reduce-scatter Y (output group)  dA (weight group)
:func:`sync_grad`               identity                         all-reduce
:func:`all_reduce_both`         all-reduce                       all-reduce
:func:`reduce_by_batch_3d`      all-reduce (input, weight)       identity (or / q**2)
:func:`split_batch_3d`          chunk by weight, then input      (autograd of a slice)
==============================  ===============================  ==============================

Every function is a collective of the groups it names: all ranks of those groups run the same
forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import all_gather_along, all_reduce, reduce_scatter_along
from kolossos.nn.layer.parallel_3d.groups import Groups3D

__all__ = [
    "all_reduce_both",
    "linear_3d",
    "reduce_by_batch_3d",
    "split_batch_3d",
    "split_tensor_3d",
    "sync_grad",
]


def _reduce_scatter_rows_async(
    x: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start the reduce-scatter of ``x``'s rows over ``group``: ``(result, work to wait on)``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x, None
    chunks = x.chunk(world, dim=0)
    flat_in = torch.cat([chunk.contiguous().view(-1) for chunk in chunks])
    out = torch.empty(chunks[0].shape, dtype=x.dtype, device=x.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = scatter(out.view(-1), flat_in, group=group, async_op=True)  # SYNC POINT (started)
    return out, work


class _Linear3D(torch.autograd.Function):
    """``Y = X A`` with ``X`` ``(rows, in/q)`` and ``A`` ``(in/q, out/q**2)`` shards."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, groups: Groups3D) -> torch.Tensor:
        x_full = all_gather_along(x, 0, groups.input)  # SYNC POINT: rows of the input group
        w_full = all_gather_along(weight, weight.dim() - 1, groups.weight)  # SYNC POINT
        ctx.save_for_backward(x_full, w_full)
        ctx.groups = groups
        partial = torch.matmul(x_full, w_full)  # summed over the output group below
        return reduce_scatter_along(partial, 0, groups.output)  # SYNC POINT: q | rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_full, w_full = ctx.saved_tensors
        groups: Groups3D = ctx.groups
        grad_full = all_gather_along(grad.contiguous(), 0, groups.output)  # SYNC POINT
        # dX's reduce-scatter runs while dA is computed (the two are independent)
        grad_x, pending = _reduce_scatter_rows_async(
            torch.matmul(grad_full, w_full.t()), groups.input
        )
        flat_x = x_full.reshape(-1, x_full.shape[-1])
        flat_g = grad_full.reshape(-1, grad_full.shape[-1])
        grad_w = reduce_scatter_along(flat_x.t() @ flat_g, 1, groups.weight)  # SYNC POINT
        if pending is not None:
            pending.wait()  # SYNC POINT: dX
        return grad_x, grad_w, None


def linear_3d(x: torch.Tensor, weight: torch.Tensor, groups: Groups3D) -> torch.Tensor:
    """The 3D matrix product ``X A`` (F0:6726-6782).

    Rank ``(w, i, o)`` (its ranks in the weight, input and output groups) holds ``X``'s rows
    block ``w * q + i`` (of ``q**2``) and columns block ``o``, and ``A``'s rows block ``o`` and
    columns block ``i * q + w``. It returns ``Y``'s rows block ``w * q + o`` and columns block
    ``i``: the layout of an input for :meth:`Groups3D.swapped`.

    Per call, forward and backward, each rank moves (ring algorithm) ``(q-1)/q`` of: the gathered
    ``X`` and ``dY`` and the reduce-scattered ``Y`` and ``dX`` (``B/q x in/q`` or ``out/q``
    each), and the gathered ``A`` and reduce-scattered ``dA`` (``in/q x out/q``).

    Args:
        x: ``(rows/q**2, ..., in/q)``.
        weight: ``(in/q, out/q**2)``.
        groups: the groups of ``x``'s layout.

    Returns:
        ``(rows/q**2, ..., out/q)``.
    """
    out: torch.Tensor = _Linear3D.apply(x, weight, groups)
    return out


class _SyncGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.group), None  # SYNC POINT


def sync_grad(param: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``param`` unchanged; in backward its gradient is summed over ``group`` — use a parameter
    replicated over ``group`` through this, so every replica gets the whole gradient."""
    if dist.get_world_size(group) == 1:
        return param
    out: torch.Tensor = _SyncGrad.apply(param, group)
    return out


class _AllReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x, group)  # SYNC POINT

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.group), None  # SYNC POINT


def all_reduce_both(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over ``group``; the gradient is summed too (each rank uses the sum on its own
    slice of the data, as a layer norm's statistics over split features)."""
    out: torch.Tensor = _AllReduceBoth.apply(x, group)
    return out


class _ReduceByBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Groups3D, reduce_mean: bool) -> torch.Tensor:
        out = all_reduce(all_reduce(x, groups.input), groups.weight)  # SYNC POINT
        ctx.scale = 1.0 / groups.depth**2 if reduce_mean else 1.0
        return out * ctx.scale if reduce_mean else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad * ctx.scale, None, None


def reduce_by_batch_3d(
    tensor: torch.Tensor, groups: Groups3D, reduce_mean: bool = False
) -> torch.Tensor:
    """Sum (or mean) of ``tensor`` over the ``q**2`` batch shards (the input and weight groups).

    The backward pass is the identity (scaled for the mean): every rank of the batch groups holds
    the same result, as a loss does.
    """
    out: torch.Tensor = _ReduceByBatch.apply(tensor, groups, reduce_mean)
    return out


def split_tensor_3d(tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's chunk of ``tensor`` along ``dim`` over ``group`` (a size-1 dimension is kept).

    Raises:
        ValueError: the dimension is not divisible by the group size.
    """
    world = dist.get_world_size(group)
    size = tensor.size(dim)
    if size <= 1:
        return tensor
    if size % world:
        raise ValueError(
            f"split_tensor_3d: dimension {dim} of size {size} is not divisible by the group size "
            f"{world}; pad it to a multiple."
        )
    return tensor.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def split_batch_3d(input_: torch.Tensor, groups: Groups3D, dim: int = 0) -> torch.Tensor:
    """This rank's batch shard: ``input_`` chunked along ``dim`` by the weight group, then by the
    input group (a size-1 dimension is kept).

    Raises:
        ValueError: the dimension is not divisible by ``q**2``.
    """
    if input_.size(dim) <= 1:
        return input_
    if input_.size(dim) % groups.depth**2:
        raise ValueError(
            f"split_batch_3d: dimension {dim} of size {input_.size(dim)} is not divisible by "
            f"q**2={groups.depth**2}; use a batch size divisible by q**2."
        )
    return split_tensor_3d(split_tensor_3d(input_, dim, groups.weight), dim, groups.input)
