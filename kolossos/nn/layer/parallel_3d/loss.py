"""Losses and the accuracy metric over 3D-parallel logits.

Logits arrive as ``(batch/q**2, ..., classes)`` blocks (:class:`Classifier3D`, the same on the
ranks of the output group) or ``(batch/q**2, ..., classes/q)`` blocks
(:class:`VocabParallelClassifier3D`); the targets are the whole batch and are split here
(:func:`split_batch_3d`). A mean is the dense mean over the whole batch: the sums of the losses
and of the counted targets are summed over the ``q**2`` batch shards
(:func:`reduce_by_batch_3d`), so ``ignore_index`` and class weights are exact too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d.cross_entropy import vocab_parallel_cross_entropy
from kolossos.nn.layer.parallel_3d._base import check_groups
from kolossos.nn.layer.parallel_3d._comm import reduce_by_batch_3d, split_batch_3d
from kolossos.nn.layer.parallel_3d.groups import Groups3D

__all__ = ["Accuracy3D", "CrossEntropyLoss3D", "VocabParallelCrossEntropyLoss3D"]

_CE_OPTIONS = ("weight", "ignore_index", "label_smoothing")


def _batch_mean(
    per_sample: torch.Tensor,
    targets: torch.Tensor,
    groups: Groups3D,
    ignore_index: int,
    weight: torch.Tensor | None,
) -> torch.Tensor:
    """The dense ``reduction="mean"`` from this shard's per-sample losses: summed losses over
    summed target weights (1 per non-ignored target), both over the batch shards."""
    keep = targets != ignore_index
    if weight is None:
        denom = keep.sum().to(per_sample.dtype)
    else:
        denom = (weight[targets.masked_fill(~keep, 0)] * keep).sum().to(per_sample.dtype)
    totals = reduce_by_batch_3d(torch.stack([per_sample.sum(), denom]), groups)  # SYNC POINT
    return totals[0] / totals[1]


class CrossEntropyLoss3D(nn.Module):
    """Cross entropy of :class:`Classifier3D` logits ``(batch/q**2, classes)``.

    Args:
        reduction: ``True``: the mean over the whole batch (the same on every rank);
            ``False``: this shard's per-sample losses.
        args: not accepted (pass ``F.cross_entropy``'s options by keyword).
        groups: the groups of the logits' layout (keyword-only).
        kwargs: ``weight``, ``ignore_index``, ``label_smoothing`` of ``F.cross_entropy``.

    Raises:
        TypeError: positional or unknown options.

    Example:
        >>> criterion = CrossEntropyLoss3D(groups=head.output_groups)  # doctest: +SKIP
        >>> loss = criterion(head(x), targets)  # targets: the whole batch  # doctest: +SKIP
    """

    def __init__(self, reduction: bool = True, *args: Any, groups: Groups3D, **kwargs: Any) -> None:
        super().__init__()
        if args:
            raise TypeError(
                f"CrossEntropyLoss3D: pass F.cross_entropy options by keyword {_CE_OPTIONS}, "
                f"not positionally ({args!r})."
            )
        unknown = set(kwargs) - set(_CE_OPTIONS)
        if unknown:
            raise TypeError(
                f"CrossEntropyLoss3D: unknown option(s) {sorted(unknown)}; supported: "
                f"{_CE_OPTIONS} (reduction is True/False)."
            )
        self.groups = check_groups("CrossEntropyLoss3D", groups)
        self.reduction_mean = reduction
        self.loss_kwargs = kwargs

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of this shard's ``logits`` against the whole batch's ``targets``."""
        targets = split_batch_3d(targets, self.groups)
        per_sample = F.cross_entropy(logits, targets, reduction="none", **self.loss_kwargs)
        if not self.reduction_mean:
            return per_sample
        ignore = int(self.loss_kwargs.get("ignore_index", -100))
        return _batch_mean(per_sample, targets, self.groups, ignore, self.loss_kwargs.get("weight"))


class VocabParallelCrossEntropyLoss3D(nn.Module):
    """Cross entropy of :class:`VocabParallelClassifier3D` logits ``(batch/q**2, classes/q)``
    (class block = the rank in the output group of ``groups``) without gathering the classes.

    Args:
        reduction: ``True``: the mean over the whole batch; ``False``: per-sample losses.
        groups: the groups of the logits' layout, i.e. the classifier's ``output_groups``
            (keyword-only).
        ignore_index: targets that contribute nothing.
        label_smoothing: as in ``F.cross_entropy``.

    Example:
        >>> criterion = VocabParallelCrossEntropyLoss3D(groups=head.output_groups)  # doctest: +SKIP
    """

    def __init__(
        self,
        reduction: bool = True,
        *,
        groups: Groups3D,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.groups = check_groups("VocabParallelCrossEntropyLoss3D", groups)
        self.reduction_mean = reduction
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of this shard's logits against the whole batch's ``targets``."""
        targets = split_batch_3d(targets, self.groups)
        per_sample = vocab_parallel_cross_entropy(
            logits,
            targets,
            self.groups.output,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction="none",
        )
        if not self.reduction_mean:
            return per_sample
        return _batch_mean(per_sample, targets, self.groups, self.ignore_index, None)


class Accuracy3D(nn.Module):
    """Number of correct predictions over the whole batch (Colossal-AI's ``Accuracy3D``: a
    count, not a ratio), from :class:`Classifier3D` logits; the same on every rank.

    Args:
        groups: the groups of the logits' layout (keyword-only).

    Example:
        >>> correct = Accuracy3D(groups=head.output_groups)(logits, targets)  # doctest: +SKIP
    """

    def __init__(self, *, groups: Groups3D) -> None:
        super().__init__()
        self.groups = check_groups("Accuracy3D", groups)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Count of ``argmax(logits) == targets`` over the batch."""
        with torch.no_grad():
            targets = split_batch_3d(targets, self.groups)
            correct = (logits.argmax(dim=-1) == targets).sum()
            return reduce_by_batch_3d(correct, self.groups)  # SYNC POINT
