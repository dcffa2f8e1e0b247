"""Colossal-AI's ``cross_entropy_1d``: cross-entropy over logits split along the vocabulary."""

from __future__ import annotations

import torch

from kolossos.nn.layer.parallel_1d._base import GroupArg, resolve_group
from kolossos.nn.layer.parallel_1d.cross_entropy import vocab_parallel_cross_entropy

__all__ = ["cross_entropy_1d"]


def cross_entropy_1d(
    vocab_logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    process_group: GroupArg = None,
) -> torch.Tensor:
    """The mean cross-entropy of ``labels`` under logits split over the vocabulary.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), labels.flatten(),
    ignore_index=ignore_index)``; the full logits are never built (two all-reduces of a few
    floats per token, none in backward). COLLECTIVE over ``process_group``.

    Args:
        vocab_logits: ``(..., V / tp)``: this rank's columns of the logits (rank ``r`` holds
            ``[r * V / tp, (r + 1) * V / tp)``).
        labels: ``(...)`` target ids, or ``ignore_index``.
        ignore_index: targets that take no part in the loss (nor in the mean's count).
        process_group: the tensor-parallel group (``None``: the world).

    Returns:
        The scalar loss, the same on every rank.

    Example:
        >>> loss = cross_entropy_1d(local_logits, labels, process_group=tp_group)  # doctest: +SKIP
    """
    group = resolve_group(process_group)
    return vocab_parallel_cross_entropy(vocab_logits, labels, group, ignore_index=ignore_index)
