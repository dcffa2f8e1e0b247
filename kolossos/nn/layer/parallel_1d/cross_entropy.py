"""Cross-entropy over vocabulary-parallel logits, without materialising the full logits.

Each rank holds the logits of its vocabulary range ``[vocab_start, vocab_start + V_local)``.
The softmax normaliser is assembled from two all-reduces over the group (the maximum, then the
target logit, the sum of exponentials and, with label smoothing, the sum of logits in one
buffer); the backward pass is local: ``softmax - (1 - eps) * onehot - eps / V``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup,
        vocab_start: int,
        vocab_size: int,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor:
        local_v = logits.shape[-1]
        x = logits.to(torch.float32, copy=True)
        valid_cols = max(0, min(local_v, vocab_size - vocab_start))
        if valid_cols < local_v:  # vocabulary padding never takes part
            x[:, valid_cols:] = float("-inf")
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)  # SYNC POINT
        x -= row_max.unsqueeze(-1)

        in_range = (target >= vocab_start) & (target < vocab_start + valid_cols)
        local_target = (target - vocab_start).masked_fill(~in_range, 0)
        picked = x.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill(~in_range, 0.0)
        logit_sum = x[:, :valid_cols].sum(dim=-1) if smoothing > 0.0 else None
        exp = x.exp_()  # in place: x is our own copy; one logits-sized buffer in all
        sums = [picked, exp.sum(dim=-1)] + ([] if logit_sum is None else [logit_sum])
        stacked = torch.stack(sums)
        dist.all_reduce(stacked, group=group)  # SYNC POINT
        log_z = stacked[1].log()
        loss = log_z - stacked[0]
        if smoothing > 0.0:
            loss = (1.0 - smoothing) * loss + smoothing * (log_z - stacked[2] / vocab_size)
        keep = target != ignore_index
        loss = loss.masked_fill(~keep, 0.0)

        exp /= stacked[1].unsqueeze(-1)  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, in_range, keep)
        ctx.smoothing, ctx.valid_cols, ctx.vocab_size = smoothing, valid_cols, vocab_size
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_target, in_range, keep = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (1.0 - ctx.smoothing) * in_range.to(grad.dtype)
        if ctx.smoothing > 0.0:
            grad[:, : ctx.valid_cols] -= ctx.smoothing / ctx.vocab_size
        grad *= (grad_loss * keep.to(grad_loss.dtype)).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def _check_args(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup,
    vocab_size: int | None,
    label_smoothing: float,
    reduction: str,
) -> int:
    """Validate the arguments (before any collective); returns the real vocabulary size."""
    world = dist.get_world_size(group)
    local_v = logits.shape[-1]
    full_v = local_v * world if vocab_size is None else vocab_size
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and labels "
            f"{tuple(labels.shape)} must agree on every dimension but the last."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {_REDUCTIONS}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1].")
    if not 0 < full_v <= local_v * world:
        raise ValueError(
            f"vocab_size={full_v} must lie in (0, {local_v * world}] (local vocabulary "
            f"{local_v} x {world} ranks)."
        )
    return full_v


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    process_group: ProcessGroup,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits, labels)`` computed from vocabulary-parallel logits.

    COLLECTIVE over ``process_group`` in forward (two all-reduces of ``labels.numel()``-sized
    buffers); the backward pass has no communication.

    Args:
        logits: ``(..., V_local)`` this rank's logits (rank ``r`` holds columns
            ``[r * V_local, (r + 1) * V_local)``), e.g. from
            :class:`~kolossos.nn.layer.parallel_1d.lm_head.VocabParallelLMHead1D`.
        labels: ``(...)`` target ids in ``[0, vocab_size)`` or ``ignore_index``.
        process_group: the tensor-parallel group the vocabulary is split over.
        vocab_size: the real vocabulary size; columns at or beyond it (padding) are excluded.
            Default: ``V_local * group size`` (no padding).
        ignore_index: targets with this value contribute no loss and no gradient.
        label_smoothing: as in ``F.cross_entropy`` (spread over the real vocabulary).
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``.

    Returns:
        The loss, identical on every rank of the group.

    Raises:
        ValueError: shapes, ``reduction`` or ``label_smoothing`` out of range.
    """
    local_v = logits.shape[-1]
    full_v = _check_args(logits, labels, process_group, vocab_size, label_smoothing, reduction)
    start = dist.get_rank(process_group) * local_v
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, local_v),
        labels.reshape(-1),
        process_group,
        start,
        full_v,
        ignore_index,
        float(label_smoothing),
    )
    assert isinstance(loss, torch.Tensor)
    if reduction == "none":
        return loss.view(labels.shape).to(logits.dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits.dtype)
    count = (labels != ignore_index).sum()
    return (total / count).to(logits.dtype)
