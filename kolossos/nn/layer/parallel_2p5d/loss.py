"""Losses and the accuracy metric on 2.5D logits.

Logits come per batch block (``(..., C)`` from
:class:`~kolossos.nn.layer.parallel_2p5d.linear.Classifier2p5D`, or ``(..., C/q)`` class
blocks from :class:`~kolossos.nn.layer.parallel_2p5d.linear.VocabParallelClassifier2p5D`); the
targets are the *whole* batch, identical on every rank, and each rank takes its block. The mean
is the dense one: the sum of the per-sample losses over all batch blocks divided by the number
of counted samples (the sum of their class weights when ``weight`` is given), so ignored targets
and uneven weights give exactly ``F.cross_entropy``'s value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d.cross_entropy import vocab_parallel_cross_entropy
from kolossos.nn.layer.parallel_2p5d._comm import reduce_by_batch_2p5d, split_batch_2p5d
from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D

__all__ = ["Accuracy2p5D", "CrossEntropyLoss2p5D", "VocabParallelCrossEntropyLoss2p5D"]

_REDUCTIONS = ("mean", "sum", "none")


def _reduction(owner: str, reduction: bool | str) -> str:
    """Colossal-AI's ``reduction=True/False`` (mean / none) or torch's names."""
    if isinstance(reduction, bool):
        return "mean" if reduction else "none"
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{owner}: reduction={reduction!r} must be True (mean), False (none) or one of "
            f"{_REDUCTIONS}."
        )
    return reduction


def _targets(
    owner: str, logits: torch.Tensor, targets: torch.Tensor, g: Groups2p5D
) -> torch.Tensor:
    if targets.is_floating_point():
        raise TypeError(
            f"{owner}: targets must be class indices (an integer tensor); class probabilities "
            "are not supported."
        )
    block = split_batch_2p5d(targets, g)
    if logits.shape[:-1] != block.shape:
        raise ValueError(
            f"{owner}: logits {tuple(logits.shape)} do not match this rank's target block "
            f"{tuple(block.shape)} (the targets are the whole batch, cut into d*q="
            f"{g.batch_parts} blocks)."
        )
    return block


class _BatchCrossEntropy(nn.Module):
    """Reduction of per-sample losses over the batch blocks (shared by both losses)."""

    def __init__(
        self,
        reduction: bool | str,
        *,
        groups: Groups2p5D,
        weight: torch.Tensor | None,
        ignore_index: int,
        label_smoothing: float,
    ) -> None:
        super().__init__()
        self.reduction = _reduction(type(self).__name__, reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(
                f"{type(self).__name__}: label_smoothing={label_smoothing} must lie in [0, 1]."
            )
        self.groups = groups
        self.ignore_index, self.label_smoothing = ignore_index, float(label_smoothing)
        self.register_buffer("weight", weight)
        self.weight: torch.Tensor | None

    def _reduce(self, per_sample: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the ``xz`` group unless ``reduction='none'``."""
        if self.reduction == "none":
            return per_sample
        total = reduce_by_batch_2p5d(per_sample.sum(), self.groups)
        if self.reduction == "sum":
            return total
        keep = targets != self.ignore_index
        if self.weight is None:
            count = keep.sum().to(per_sample.dtype)
        else:
            count = (self.weight[targets.masked_fill(~keep, 0)] * keep).sum().to(per_sample.dtype)
        count = count.reshape(1).detach().clone()
        dist.all_reduce(count, group=self.groups.xz)  # SYNC POINT
        return total / count[0]


class CrossEntropyLoss2p5D(_BatchCrossEntropy):
    """Cross entropy of whole-class logits per batch block (Colossal-AI's
    ``CrossEntropyLoss2p5D``).

    Args:
        reduction: ``True`` / ``"mean"``, ``"sum"``, or ``False`` / ``"none"`` (this rank's
            per-sample losses).
        groups: the tesseract's groups.
        weight: class weights, as in ``F.cross_entropy``.
        ignore_index: targets with this value count neither in the loss nor in the mean.
        label_smoothing: as in ``F.cross_entropy``.

    Example:
        >>> loss = CrossEntropyLoss2p5D(groups=groups)(logits_blk, targets)  # doctest: +SKIP
    """

    def __init__(
        self,
        reduction: bool | str = True,
        *,
        groups: Groups2p5D,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(
            reduction,
            groups=groups,
            weight=weight,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
        )

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        block = _targets(type(self).__name__, logits, targets, self.groups)
        per_sample = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            block.reshape(-1),
            self.weight,
            ignore_index=self.ignore_index,
            reduction="none",
            label_smoothing=self.label_smoothing,
        ).view(block.shape)
        return self._reduce(per_sample, block)


class VocabParallelCrossEntropyLoss2p5D(_BatchCrossEntropy):
    """Cross entropy of class-split logits ``(..., C/q)`` (Colossal-AI's
    ``VocabParallelCrossEntropyLoss2p5D``): the softmax normaliser is reduced over the grid
    row, never materialising the whole logits.

    Args:
        reduction: ``True`` / ``"mean"``, ``"sum"``, or ``False`` / ``"none"``.
        groups: the tesseract's groups.
        ignore_index: targets with this value count neither in the loss nor in the mean.
        label_smoothing: as in ``F.cross_entropy``.

    Example:
        >>> loss_fn = VocabParallelCrossEntropyLoss2p5D(groups=groups)  # doctest: +SKIP
        >>> loss = loss_fn(vocab_logits_blk, targets)  # doctest: +SKIP
    """

    def __init__(
        self,
        reduction: bool | str = True,
        *,
        groups: Groups2p5D,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(
            reduction,
            groups=groups,
            weight=None,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
        )

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the grid row (and the ``xz`` group for the mean or sum)."""
        block = _targets(type(self).__name__, logits, targets, self.groups)
        per_sample = vocab_parallel_cross_entropy(
            logits,
            block,
            self.groups.row,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction="none",
        )
        return self._reduce(per_sample, block)


class Accuracy2p5D(nn.Module):
    """The number of correct predictions in the whole batch (Colossal-AI's ``Accuracy2p5D``):
    ``metric(logits_blk, targets)`` with whole-class logits per batch block and the whole
    batch's targets; the same 0-dim integer tensor on every rank. COLLECTIVE over the ``xz``
    group.

    Example:
        >>> correct = Accuracy2p5D(groups)(logits_blk, targets)  # doctest: +SKIP
    """

    def __init__(self, groups: Groups2p5D) -> None:
        super().__init__()
        self.groups = groups

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            block = _targets(type(self).__name__, logits, targets, self.groups)
            correct = (logits.argmax(dim=-1) == block).sum().reshape(1)
            dist.all_reduce(correct, group=self.groups.xz)  # SYNC POINT
            return correct[0]
