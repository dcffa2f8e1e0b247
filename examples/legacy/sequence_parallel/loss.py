"""``BertLoss``: the masked-LM loss of whole sentences, computed from their sequence chunks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc


class BertLoss(nn.Module):
    """Mean cross-entropy over every masked token of the replica's sentences, all chunks included.

    Each rank sums its chunk's token losses and divides by the number of targets in the whole
    sentences (an all-reduce of the counts over the sequence group). The sequence ranks then
    hold shares that add up to the loss; the gradient all-reduce *averages* over the
    ``P``-rank sequence group, so each rank returns ``P`` times its share: the mean of the
    values over the sequence group is the loss, and the averaged gradient is its gradient.

    Args:
        group: the sequence-parallel group (default: ``gpc``'s ``ParallelMode.SEQUENCE``).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = gpc.get_group(ParallelMode.SEQUENCE) if group is None else group

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``logits [b, s, vocab]`` and ``labels [b, s]`` of this rank's chunk (COLLECTIVE)."""
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        count = (labels >= 0).sum().to(total.dtype).reshape(1)
        dist.all_reduce(count, group=self.group)  # SYNC POINT: targets of the whole sentences
        return total * dist.get_world_size(self.group) / count.clamp(min=1.0)

    def __deepcopy__(self, memo: dict[int, object]) -> BertLoss:
        return BertLoss(self.group)
