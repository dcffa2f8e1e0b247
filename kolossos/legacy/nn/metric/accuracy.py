"""``Accuracy``: the number of correct predictions in a batch, as Colossal-AI's
``colossalai.nn.metric.Accuracy`` counts them (the legacy ``AccuracyHook`` sums the counts).

It follows the launch config's tensor parallelism. Without it, or in ``'1d'`` mode with whole
logits, the prediction is ``argmax(logits, -1)``. In ``'1d'`` mode the logits may arrive split
over the tensor group along the class dimension (the output of a column-parallel ``Linear``): the
ranks then agree on the global argmax from each one's best class (one small all-gather per
batch; ties go to the lowest class index, as ``torch.argmax`` does on whole logits). In
``'2d'``, ``'2.5d'`` and ``'3d'`` mode it is the mode's accuracy (``Accuracy2D`` ...: logits and
targets in batch blocks, the count summed over the whole batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.legacy.nn.layer.modes import mode_layers
from kolossos.legacy.nn.layer.parallel_2d import Accuracy2D
from kolossos.legacy.nn.layer.parallel_2p5d import Accuracy2p5D
from kolossos.legacy.nn.layer.parallel_3d import Accuracy3D
from kolossos.legacy.tensor_parallel import (
    get_parallel_input,
    get_tensor_parallel_group,
    read_tensor_parallel_settings,
)

__all__ = ["Accuracy", "Accuracy2D", "Accuracy2p5D", "Accuracy3D", "calc_acc"]


def calc_acc(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The number of rows of ``logits`` whose argmax over the last dimension equals
    ``targets``.

    Example:
        >>> calc_acc(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])).item()
        1
    """
    return torch.sum(targets == torch.argmax(logits, dim=-1))


def _gather(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)  # SYNC POINT over the TP group
    return torch.stack(parts)


def split_argmax(logits: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The argmax over the last dimension of logits split (in rank order) over ``group``:
    global class indices, identical on every rank of the group. COLLECTIVE over ``group``."""
    local_index = torch.argmax(logits, dim=-1)
    local_best = logits.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
    widths = _gather(torch.tensor(logits.shape[-1], device=logits.device), group)
    offsets = torch.cumsum(widths, 0) - widths  # the first class each rank holds
    offsets = offsets.view(-1, *([1] * local_index.dim()))
    bests = _gather(local_best, group)
    indices = _gather(local_index, group) + offsets
    winner = torch.argmax(bests, dim=0, keepdim=True)  # first rank on ties: lowest class
    return indices.gather(0, winner).squeeze(0)


class Accuracy(nn.Module):
    """Counts correct predictions: ``metric(logits, targets)`` is a 0-dim integer tensor.

    Args:
        parallel_output: (``'1d'`` mode) whether the logits are split over the tensor group
            along the class dimension. ``None``: as the legacy layers left them — split when the
            last ``kolossos.nn.Linear`` built was column-parallel without ``gather_output``.

    Raises:
        ValueError: ``parallel_output=True`` without ``'1d'`` tensor parallelism.

    Example:
        >>> metric = Accuracy()
        >>> metric(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 0])).item()
        2
    """

    def __init__(self, parallel_output: bool | None = None) -> None:
        super().__init__()
        settings = read_tensor_parallel_settings()
        layers = mode_layers(settings.mode)
        self._mode_accuracy = None if layers is None else layers.accuracy()
        if parallel_output and settings.mode != "1d":
            raise ValueError(
                "Accuracy(parallel_output=True) needs parallel.tensor mode='1d' in the launch "
                "config; without tensor parallelism the logits are whole: drop the argument."
            )
        if parallel_output is None:
            parallel_output = settings.mode == "1d" and get_parallel_input()
        self.parallel_output = parallel_output
        # COLLECTIVE the first time the tensor groups are created (the layers usually did it)
        self._group = get_tensor_parallel_group(settings) if parallel_output else None

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The number of samples whose predicted class is the target. COLLECTIVE over the
        tensor group when the logits are split, and in 2d/2.5d/3d mode."""
        with torch.no_grad():
            if self._mode_accuracy is not None:
                return self._mode_accuracy(logits, targets)
            if self._group is None:
                return calc_acc(logits, targets)
            return torch.sum(targets == split_argmax(logits, self._group))
