"""Losses and the accuracy metric of 2D tensor parallelism.

The logits arrive as blocks of batch block ``i``: whole classes from :class:`Classifier2D`
(``[B/q, N]``, the same on every rank of a grid row) or class block ``j`` from
:class:`VocabParallelClassifier2D` (``[B/q, N/q]``). The targets are the *whole* batch (the same
on every rank); each rank keeps its batch block (:func:`split_batch_2d`) and the per-block sums
are added over the column group (:func:`reduce_by_batch_2d`), so every rank returns the loss of
the whole batch — equal to the dense ``F.cross_entropy`` (weighted mean over the non-ignored
targets).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d.cross_entropy import vocab_parallel_cross_entropy
from kolossos.nn.layer.parallel_2d._comm import reduce_by_batch_2d, split_batch_2d
from kolossos.nn.layer.parallel_2d.grid import Groups2D

__all__ = ["Accuracy2D", "CrossEntropyLoss2D", "VocabParallelCrossEntropyLoss2D"]

_CE_OPTIONS = ("weight", "size_average", "ignore_index", "reduce", "label_smoothing")


def _check_groups(owner: str, groups: object) -> Groups2D:
    if not isinstance(groups, Groups2D):
        raise TypeError(f"{owner}: groups={groups!r} must be a Groups2D(row=..., col=...).")
    return groups


def _global_mean(
    losses: torch.Tensor, denominators: torch.Tensor, groups: Groups2D
) -> torch.Tensor:
    """``sum(losses) / sum(denominators)`` over the whole batch: one all-reduce of two numbers
    over the column group (the gradient flows through the loss sum only)."""
    totals = torch.stack([losses.sum(), denominators.sum().to(losses.dtype).detach()])
    totals = reduce_by_batch_2d(totals, groups)
    return totals[0] / totals[1]


class CrossEntropyLoss2D(nn.Module):
    """Cross-entropy of whole-class logits ``[B/q, N]`` (batch block ``i``) against the whole
    batch of targets.

    Args:
        reduction: ``True``: the mean over the whole batch (as ``F.cross_entropy``'s
            ``"mean"``, weighted and without ignored targets); ``False``: this rank's per-sample
            losses ``[B/q]``.
        args: ``F.cross_entropy``'s options after ``target``, by position (``weight``, ...).
        groups: the grid.
        kwargs: ``F.cross_entropy``'s options by name (``weight``, ``ignore_index``,
            ``label_smoothing``); ``size_average`` / ``reduce`` are not accepted.

    Example:
        >>> criterion = CrossEntropyLoss2D(groups=groups)  # doctest: +SKIP
        >>> loss = criterion(head(x_ij), targets)  # the same on every rank  # doctest: +SKIP
    """

    def __init__(self, reduction: bool = True, *args: Any, groups: Groups2D, **kwargs: Any):
        super().__init__()
        name = type(self).__name__
        self.groups = _check_groups(name, groups)
        options = dict(zip(_CE_OPTIONS, args, strict=False))
        if len(args) > len(_CE_OPTIONS) or set(options) & set(kwargs):
            raise TypeError(f"{name}: too many or repeated options {args!r}, {sorted(kwargs)}.")
        options.update(kwargs)
        unknown = set(options) - set(_CE_OPTIONS)
        deprecated = {k for k in ("size_average", "reduce") if options.get(k) is not None}
        if unknown or deprecated:
            raise TypeError(
                f"{name}: options {sorted(unknown | deprecated)} are not supported; use "
                "reduction=True/False and weight / ignore_index / label_smoothing."
            )
        self.reduction_mean = bool(reduction)
        self.weight: torch.Tensor | None
        self.register_buffer("weight", options.get("weight"), persistent=False)
        self.ignore_index: int = int(options.get("ignore_index", -100))
        self.label_smoothing: float = float(options.get("label_smoothing", 0.0))

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the column group (with ``reduction``)."""
        targets = split_batch_2d(targets, self.groups)
        losses = F.cross_entropy(
            logits,
            targets,
            self.weight,
            ignore_index=self.ignore_index,
            reduction="none",
            label_smoothing=self.label_smoothing,
        )
        if not self.reduction_mean:
            return losses
        keep = targets != self.ignore_index
        denominators = keep.to(losses.dtype)
        if self.weight is not None:
            denominators = denominators * self.weight[targets.masked_fill(~keep, 0)]
        return _global_mean(losses, denominators, self.groups)


class VocabParallelCrossEntropyLoss2D(nn.Module):
    """Cross-entropy of class-split logits ``[B/q, N/q]`` (block ``(i, j)``) without gathering
    them: the softmax normaliser is assembled over the row group.

    Args:
        reduction: ``True``: the mean over the non-ignored targets of the whole batch;
            ``False``: this rank's per-sample losses ``[B/q]``.
        groups: the grid.
        ignore_index: targets with this value give no loss and no gradient.
        label_smoothing: as in ``F.cross_entropy``.

    Example:
        >>> criterion = VocabParallelCrossEntropyLoss2D(groups=groups)  # doctest: +SKIP
        >>> loss = criterion(vocab_head(x_ij), targets)  # doctest: +SKIP
    """

    def __init__(
        self,
        reduction: bool = True,
        *,
        groups: Groups2D,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.groups = _check_groups(type(self).__name__, groups)
        self.reduction_mean = bool(reduction)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the row group (and the column group with ``reduction``)."""
        targets = split_batch_2d(targets, self.groups)
        losses = vocab_parallel_cross_entropy(
            logits,
            targets,
            self.groups.row,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction="none",
        )
        if not self.reduction_mean:
            return losses
        return _global_mean(losses, (targets != self.ignore_index), self.groups)


class Accuracy2D(nn.Module):
    """The number of correct predictions in the whole batch, from whole-class logits
    ``[B/q, N]`` (:class:`Classifier2D`) and the whole batch of targets; the same 0-dim integer
    tensor on every rank.

    Args:
        groups: the grid.

    Example:
        >>> Accuracy2D(groups=groups)(head(x_ij), targets)  # doctest: +SKIP
        tensor(5)
    """

    def __init__(self, *, groups: Groups2D) -> None:
        super().__init__()
        self.groups = _check_groups(type(self).__name__, groups)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the column group."""
        with torch.no_grad():
            targets = split_batch_2d(targets, self.groups)
            correct = torch.sum(targets == torch.argmax(logits, dim=-1))
            return reduce_by_batch_2d(correct, self.groups)
