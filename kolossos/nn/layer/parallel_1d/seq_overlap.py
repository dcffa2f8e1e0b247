"""The entry of a sequence-parallel ('split_gather') region with its backward communication
overlapped with the gradient matmuls (Colossal-AI's ``enable_sequence_overlap``).

Forward is the plain one: the sequence shards are all-gathered and every column-parallel linear
of the region is applied to the full sequence. Only the shard is kept for backward, which then

1. starts the all-gather of the input shards again (the weight gradients need the full input)
   and, while it runs, computes the input gradient ``sum_i grad_y_i W_i`` and the bias
   gradients, which do not need the input;
2. starts the reduce-scatter of the input gradient and, while it runs, computes the weight
   gradients ``grad_y_i^T x`` from the gathered input.

Each handle is waited for before backward returns. The arithmetic is that of the plain entry
followed by the column matmuls (tests/parity/test_sp_ring_mode.py: the same losses and
parameters bit for bit); the gathered activation is not stored (one extra all-gather per region
in backward instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import all_gather_along

__all__ = ["overlapped_gather_linears"]


def _start_all_gather(local: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, Any]:
    world = dist.get_world_size(group)
    flat = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return flat, gather(flat, local.view(-1), group=group, async_op=True)  # SYNC POINT (async)


def _start_reduce_scatter(
    full: torch.Tensor, dim: int, group: ProcessGroup
) -> tuple[torch.Tensor, tuple[int, ...], Any]:
    world = dist.get_world_size(group)
    chunks = full.chunk(world, dim=dim)
    flat_in = torch.cat([chunk.contiguous().view(-1) for chunk in chunks])
    out = torch.empty(chunks[0].numel(), dtype=full.dtype, device=full.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = scatter(out, flat_in, group=group, async_op=True)  # SYNC POINT (async)
    return out, tuple(chunks[0].shape), work


class _OverlappedGatherLinears(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, *params: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        weights, biases = params[0::2], params[1::2]
        full = all_gather_along(x, dim, group)
        ys = []
        for w, b in zip(weights, biases, strict=True):
            assert w is not None
            ys.append(F.linear(full, w, b))
        ctx.save_for_backward(x, *weights)  # the shard only: gathered again in backward
        ctx.dim, ctx.group, ctx.has_bias = dim, group, [b is not None for b in biases]
        ctx.set_materialize_grads(False)
        return (full, *ys)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor | None, *grad_ys: torch.Tensor | None) -> Any:
        x, *weights = ctx.saved_tensors
        dim, group, world = ctx.dim, ctx.group, dist.get_world_size(ctx.group)
        local = x.contiguous()
        flat, work = _start_all_gather(local, group)
        # independent of the input: overlaps the all-gather. Summed last layer first, the order
        # in which autograd accumulates the plain entry's gradient (its engine runs the later
        # consumers' nodes first), so overlap on and off agree bit for bit.
        grad_in = grad_full
        for g, w in reversed(list(zip(grad_ys, weights, strict=True))):
            if g is not None:
                piece = g.matmul(w)
                grad_in = piece if grad_in is None else grad_in + piece
        grads: list[torch.Tensor | None] = []
        for i, g in enumerate(grad_ys):
            wants_b = ctx.needs_input_grad[4 + 2 * i] and ctx.has_bias[i] and g is not None
            grads += [None, g.reshape(-1, g.shape[-1]).sum(0) if wants_b else None]  # type: ignore[union-attr]
        work.wait()  # SYNC POINT
        full = torch.cat(flat.view(world, *local.shape).unbind(0), dim=dim)
        grad_x, rs_work = None, None
        if grad_in is not None and ctx.needs_input_grad[0]:
            grad_x, shape, rs_work = _start_reduce_scatter(grad_in, dim, group)
        # the weight gradients overlap the reduce-scatter
        for i, g in enumerate(grad_ys):
            if g is not None and ctx.needs_input_grad[3 + 2 * i]:
                g2 = g.reshape(-1, g.shape[-1])
                grads[2 * i] = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        if rs_work is not None:
            rs_work.wait()  # SYNC POINT
            assert grad_x is not None
            grad_x = grad_x.view(shape)
        return (grad_x, None, None, *grads)


def overlapped_gather_linears(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: ProcessGroup,
    dim: int = 1,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather the sequence shards ``x`` along ``dim`` and apply every column-parallel linear,
    with the backward communication overlapped (see the module docstring). COLLECTIVE over
    ``group`` (forward and backward).

    Args:
        x: this rank's sequence shard.
        weights: the column layers' weight shards, each ``(out_i, in)``.
        biases: their bias shards (``None`` for none), one per weight.
        group: the tensor-parallel group.
        dim: the sequence dimension.

    Returns:
        ``(full_x, [linear(full_x, w_i, b_i)])``.

    Example:
        >>> full, (up,) = overlapped_gather_linears(shard, [w_up], [b_up], tp)  # doctest: +SKIP
    """
    if len(weights) != len(biases):
        raise ValueError(
            f"overlapped_gather_linears: {len(weights)} weights but {len(biases)} biases; pass "
            "one bias (or None) per weight."
        )
    dim %= x.dim()
    if dist.get_world_size(group) == 1:
        return x, [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    params: list[torch.Tensor | None] = []
    for w, b in zip(weights, biases, strict=True):
        params += [w, b]
    full, *ys = _OverlappedGatherLinears.apply(x, dim, group, *params)
    return full, list(ys)
