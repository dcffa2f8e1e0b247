"""The functions the graph executor (:mod:`~kolossos.auto_parallel.apply_graph`) inserts
into a traced graph: layout conversions on the edges between operators, and the operators
whose sharded form is not the ATen operator on local tensors (row-parallel matmul,
vocabulary-parallel embedding, the losses, a batch-sharded BatchNorm's synchronised
statistics).

Every tensor of a running plan is in one of three *kinds* on a 1-d mesh:

* ``S`` (sharded): this rank holds its slice along one dimension (layout ``B`` or ``F``);
* ``P`` (partial gradient): every rank holds the whole tensor, but it is used by a sharded
  operator, so each rank's gradient is only its share (the true gradient is their sum);
* ``R`` (replicated): every rank holds the whole tensor and computes the whole gradient.

:func:`relayout` moves a tensor between kinds with the matching backward (an all-gather
forward is a slice backward, a slice forward is an all-gather backward, ``R → P`` is
Megatron's *f*: identity forward, all-reduce backward).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_reduce_scatter_grad,
    reduce_from_tp,
    split_along,
    split_to_tp,
)
from kolossos.nn.layer.parallel_1d.cross_entropy import vocab_parallel_cross_entropy

__all__ = [
    "Kind",
    "batch_cross_entropy",
    "constant_part",
    "gather_sequence",
    "relayout",
    "row_matmul",
    "scale_grad",
    "shard_of",
    "sync_batch_norm",
    "vocab_cross_entropy",
    "vocab_embedding",
    "write_back",
]

Kind = Literal["S", "P", "R"]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _SplitPadGrad(torch.autograd.Function):
    """``P → S``: this rank's slice forward; backward the slice's gradient in place, zeros
    elsewhere (a partial gradient: the ranks' sum is the whole)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.shape = dim, x.shape
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = grad.new_zeros(ctx.shape)
        size = ctx.shape[ctx.dim] // ctx.world
        full.narrow(ctx.dim, ctx.rank * size, size).copy_(grad)
        return full, None, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward; the gradient times ``factor`` backward."""
    out: torch.Tensor = _ScaleGrad.apply(x, factor)
    return out


def relayout(
    x: torch.Tensor,
    src: Kind,
    src_dim: int | None,
    dst: Kind,
    dst_dim: int | None,
    group: ProcessGroup,
) -> torch.Tensor:
    """``x`` moved from kind ``src`` (sharded on ``src_dim`` when ``S``) to ``dst``."""
    world = dist.get_world_size(group)
    if (src == dst and src_dim == dst_dim) or world == 1:
        return x
    if src == "S":
        assert src_dim is not None
        if dst == "P":
            return gather_seq_reduce_scatter_grad(x, group, src_dim)
        x = gather_from_tp(x, group, src_dim)
        src = "R"
        if dst == "R":
            return x
    if dst == "S":
        assert dst_dim is not None
        if src == "P":
            out: torch.Tensor = _SplitPadGrad.apply(x, dst_dim, group)
            return out
        return split_to_tp(x, group, dst_dim)
    if src == "R" and dst == "P":
        return copy_to_tp(x, group)
    if src == "P" and dst == "R":
        return scale_grad(x, 1.0 / world)
    return x


def gather_sequence(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's part of the sequence along ``dim`` forward; backward each rank's
    gradients of the whole summed and scattered back (keys and values of a
    sequence-sharded attention)."""
    return gather_seq_reduce_scatter_grad(x, group, dim)


def constant_part(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's slice of a constant (a mask built from positions) along ``dim``."""
    return split_along(x, dim, group)


def shard_of(full: torch.Tensor, dim: int, chunks: int, rank: int, world: int) -> torch.Tensor:
    """This rank's part of ``full`` along ``dim``: its slice of each of ``chunks`` equal
    chunks, concatenated (``chunks=3``: GPT-2's fused q, k, v columns, each split by head)."""
    parts = full.chunk(chunks, dim=dim)
    return torch.cat([p.chunk(world, dim=dim)[rank] for p in parts], dim=dim)


def row_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv1d: bool,
    group: ProcessGroup,
) -> torch.Tensor:
    """Row-parallel ``x @ weight`` (``Conv1D``'s ``[in, out]`` weight, else ``nn.Linear``'s
    ``[out, in]``) on this rank's input features, summed over ``group``, plus the bias."""
    partial = x @ weight if conv1d else F.linear(x, weight)
    out = reduce_from_tp(partial, group)
    return out if bias is None else out + bias


def vocab_embedding(
    weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, group: ProcessGroup
) -> torch.Tensor:
    """Embedding lookup in a table split by rows over ``group`` (this rank's rows
    ``[rank·V/P, (rank+1)·V/P)``): ids outside them give zeros, the ranks' outputs are summed;
    ``padding_idx`` (a global row, ``-1`` for none) gets no gradient."""
    rows = weight.shape[0]
    start = dist.get_rank(group) * rows
    outside = (ids < start) | (ids >= start + rows)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else None
    local = F.embedding((ids - start).masked_fill(outside, 0), weight, padding_idx=pad)
    local = local.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(local, group)


def _check_mean(reduction: int, where: str) -> None:
    if reduction != 1:
        raise NotImplementedError(
            f"{where}: only reduction='mean' (1) is supported on a sharded loss; got {reduction}."
        )


def batch_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
    group: ProcessGroup,
) -> torch.Tensor:
    """Cross entropy of this rank's part of the batch, as the whole batch's mean: the local sum
    divided by the number of counted targets over all ranks, summed over ``group`` forward
    (the same loss on every rank) and this rank's share backward."""
    _check_mean(reduction, "batch_cross_entropy")
    total = F.cross_entropy(
        logits,
        labels,
        weight=weight,
        reduction="sum",
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    count = (labels != ignore_index).sum().to(total.dtype)
    dist.all_reduce(count, group=group)
    return reduce_from_tp(total / count, group)


def vocab_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
    group: ProcessGroup,
) -> torch.Tensor:
    """Cross entropy of logits split over the vocabulary (each rank its columns)."""
    _check_mean(reduction, "vocab_cross_entropy")
    if weight is not None:
        raise NotImplementedError("vocab_cross_entropy: class weights are not supported.")
    return vocab_parallel_cross_entropy(
        logits, labels, group, ignore_index=ignore_index, label_smoothing=label_smoothing
    )


def write_back(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a buffer's new value (a functionalised BatchNorm's running statistic) into it."""
    with torch.no_grad():
        buffer.copy_(value)


class _SyncBatchNorm(torch.autograd.Function):
    """Batch normalisation of a batch split over ``group`` with the whole batch's statistics.

    Forward: two all-reduces (per-channel sums with the row count, then the per-channel sums of
    squared deviations from the global mean: the two-pass variance, as accurate as one
    process's); the running statistics are updated with the global mean and the unbiased
    global variance. Backward: one all-reduce of the per-channel sums of the output gradient
    and of its product with the normalised input. The weight's and bias's gradients returned
    are this rank's shares (the executor sums them over the mesh with the other gradients).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running: tuple[torch.Tensor | None, torch.Tensor | None, float],
        eps: float,
        group: ProcessGroup,
    ) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        stats = torch.cat([x.sum(dims), x.new_full((1,), x.numel() / x.shape[1])])
        dist.all_reduce(stats, group=group)  # sync point: channel sums and the row count
        count = float(stats[-1])
        mean = stats[:-1] / count
        centred = x - mean.view(shape)
        squares = centred.square().sum(dims)
        dist.all_reduce(squares, group=group)  # sync point: sums of squared deviations
        var = squares / count
        invstd = torch.rsqrt(var + eps)
        xhat = centred * invstd.view(shape)
        running_mean, running_var, momentum = running
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(var * (count / max(count - 1, 1)), alpha=momentum)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.group, ctx.dims, ctx.shape = count, group, dims, shape
        ctx.has_bias = bias is not None
        out = xhat if weight is None else xhat * weight.view(shape)
        return out if bias is None else out + bias.view(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape, channels = ctx.dims, ctx.shape, xhat.shape[1]
        local = torch.cat([grad.sum(dims), (grad * xhat).sum(dims)])
        sums = local.clone()
        dist.all_reduce(sums, group=ctx.group)  # sync point: the whole batch's two sums
        mean_dy = (sums[:channels] / ctx.count).view(shape)
        mean_dy_xhat = (sums[channels:] / ctx.count).view(shape)
        scale = invstd if weight is None else invstd * weight
        grad_x = scale.view(shape) * (grad - mean_dy - xhat * mean_dy_xhat)
        grad_weight = local[channels:] if weight is not None else None
        grad_bias = local[:channels] if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None


def sync_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    cudnn_enabled: bool,
    group: ProcessGroup,
) -> torch.Tensor:
    """``aten.batch_norm`` on this rank's rows of a batch split over ``group``: in training
    the whole batch's per-channel statistics (as ``SyncBatchNorm``, written with gloo-capable
    collectives), in evaluation the running statistics."""
    if not training:
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    if x.dim() < 2:
        raise ValueError(f"sync_batch_norm: input of shape {tuple(x.shape)} has no channels.")
    out: torch.Tensor = _SyncBatchNorm.apply(
        x, weight, bias, (running_mean, running_var, momentum), eps, group
    )
    return out
