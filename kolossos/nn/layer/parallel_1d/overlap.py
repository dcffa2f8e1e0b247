"""Linear layers whose communication overlaps computation: the column-parallel backward
(Colossal-AI's ``overlap=True`` / ``async_communication=True``) and the row-parallel chunked
all-reduce for inference (``stream_chunk_num``).

The column-parallel backward, two cases, both giving the numbers of the plain layer:

* **Sequence parallel** (the input is a sequence shard): forward all-gathers the input but keeps
  only the *shard* for backward (the gathered activation is not stored). Backward launches the
  all-gather of the input again, computes the input gradient (and the bias gradient) meanwhile,
  then launches the reduce-scatter of the input gradient and computes the weight gradient from
  the gathered input while it runs.
* **Replicated input**: backward launches the all-reduce of the input gradient and computes the
  weight gradient while it runs (Megatron's asynchronous gradient all-reduce).

Work handles are waited for before backward returns, so the overlap is within this layer's
backward; on NCCL the collectives run on their own stream next to the matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import all_gather_along

__all__ = ["chunked_row_linear", "overlapped_column_linear"]


def _async_all_gather(flat_out: torch.Tensor, local: torch.Tensor, group: ProcessGroup) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(flat_out, local, group=group, async_op=True)  # SYNC POINT (async)


def _async_reduce_scatter(out: torch.Tensor, flat_in: torch.Tensor, group: ProcessGroup) -> Any:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, flat_in, group=group, async_op=True)  # SYNC POINT (async)


def _weight_grad(grad_y: torch.Tensor, x: torch.Tensor, conv1d_layout: bool) -> torch.Tensor:
    """``dL/dW`` in the weight's stored layout (``(out, in)``, or ``(in, out)`` for Conv1D)."""
    g2 = grad_y.reshape(-1, grad_y.shape[-1])
    x2 = x.reshape(-1, x.shape[-1]).to(g2.dtype)
    return x2.t().matmul(g2) if conv1d_layout else g2.t().matmul(x2)


class _OverlappedColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup,
        seq_dim: int | None,
        conv1d_layout: bool,
    ) -> torch.Tensor:
        ctx.group, ctx.seq_dim, ctx.conv1d_layout = group, seq_dim, conv1d_layout
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)  # the shard only, under sequence parallelism
        full = x if seq_dim is None else all_gather_along(x, seq_dim, group)
        w = weight.t() if conv1d_layout else weight
        return F.linear(full, w, bias)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        group, seq_dim = ctx.group, ctx.seq_dim
        world = dist.get_world_size(group)
        w = (weight.t() if ctx.conv1d_layout else weight).to(grad_y.dtype)  # (out, in)
        grad_y = grad_y.contiguous()
        if seq_dim is None or world == 1:
            grad_x = grad_y.matmul(w)
            work = dist.all_reduce(grad_x, group=group, async_op=True) if world > 1 else None
            grad_w = _weight_grad(grad_y, x, ctx.conv1d_layout)  # overlaps the all-reduce
            grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
            if work is not None:
                work.wait()
            return _cast(grad_x, x), _cast(grad_w, weight), _cast(grad_b, weight), *_NONES
        local = x.contiguous()
        gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        work = _async_all_gather(gathered, local.view(-1), group)
        grad_full_x = grad_y.matmul(w)  # overlaps the all-gather of the input
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
        work.wait()
        full_x = torch.cat(gathered.view(world, *local.shape).unbind(0), dim=seq_dim)
        chunks = grad_full_x.chunk(world, dim=seq_dim)
        flat_in = torch.cat([chunk.contiguous().view(-1) for chunk in chunks])
        grad_x = torch.empty(chunks[0].numel(), dtype=flat_in.dtype, device=flat_in.device)
        work = _async_reduce_scatter(grad_x, flat_in, group)
        grad_w = _weight_grad(grad_y, full_x, ctx.conv1d_layout)  # overlaps the reduce-scatter
        work.wait()
        grad_x = grad_x.view(chunks[0].shape)
        return _cast(grad_x, x), _cast(grad_w, weight), _cast(grad_b, weight), *_NONES


_NONES = (None, None, None)


def _cast(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def overlapped_column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: ProcessGroup,
    *,
    seq_dim: int | None,
    conv1d_layout: bool,
) -> torch.Tensor:
    """``linear(x, weight, bias)`` for a column-parallel layer with overlapped backward
    communication (see the module docstring). COLLECTIVE over ``group`` in backward (and in
    forward when ``seq_dim`` is given).

    Args:
        x: the input: replicated (``seq_dim=None``) or this rank's shard along ``seq_dim``.
        weight: this rank's weight shard, ``(out, in)`` or ``(in, out)`` when ``conv1d_layout``.
        bias: this rank's bias shard, or ``None``.
        group: the tensor-parallel group.
        seq_dim: the sequence dimension of a sequence-parallel input; ``None``: replicated.
        conv1d_layout: ``weight`` is stored ``(in, out)`` (transformers' ``Conv1D``).
    """
    if seq_dim is not None:
        seq_dim %= x.dim()
    out: torch.Tensor = _OverlappedColumnLinear.apply(
        x, weight, bias, group, seq_dim, conv1d_layout
    )
    return out


def chunked_row_linear(
    x: torch.Tensor, weight: torch.Tensor, chunks: int, group: ProcessGroup
) -> torch.Tensor:
    """Inference: ``x @ weight.T`` summed over ``group``, computed in ``chunks`` pieces of the
    output features whose all-reduces are issued asynchronously as soon as each piece is ready.
    No autograd graph is recorded. COLLECTIVE over ``group``.

    Args:
        x: this rank's slice of the input features.
        weight: this rank's ``(out, in / tp)`` weight shard.
        chunks: the number of pieces of the output features.
        group: the tensor-parallel group.
    """
    parts, works = [], []
    with torch.no_grad():
        for piece in weight.chunk(chunks, dim=0):
            part = F.linear(x, piece)
            if dist.get_world_size(group) > 1:  # SYNC POINT (async, waited below)
                works.append(dist.all_reduce(part, group=group, async_op=True))
            parts.append(part)
        for work in works:
            work.wait()
    return torch.cat(parts, dim=-1)
