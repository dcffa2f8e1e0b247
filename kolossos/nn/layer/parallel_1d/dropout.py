"""Dropout under tensor parallelism: the same mask on every rank where the activations are
replicated over the group, independent masks where they are sharded (a column-parallel output,
a sequence shard under sequence parallelism, the local attention heads)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d._base import (
    GroupArg,
    ParallelModule1D,
    deepcopy_sharing_group,
    resolve_group,
)
from kolossos.nn.layer.parallel_1d.random import ensure_tp_rng_states, get_tp_rng_tracker

__all__ = ["Dropout1D", "DropoutForParallelInput", "DropoutForReplicatedInput"]


class Dropout1D(ParallelModule1D, nn.Dropout):
    """``nn.Dropout`` drawing its mask from the group's tensor-parallel random state (a
    :class:`ParallelModule1D` without parameters, so ``isinstance`` checks for Colossal-AI's
    ``ParallelModule`` hold).

    Masks derive from the default generator (see :mod:`kolossos.nn.layer.parallel_1d.random`):
    reproduced under activation checkpointing, identical on the ranks of the group when their
    default generators agree and ``parallel_input`` is off.

    Args:
        p: drop probability.
        inplace: as in ``nn.Dropout``.
        parallel_input: the input is sharded over the group (independent masks per rank);
            ``False``: replicated (the same mask on every rank).
        process_group: the tensor-parallel group (default: the world).
    """

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        parallel_input: bool = False,
        process_group: GroupArg = None,
    ) -> None:
        super().__init__(p, inplace)
        self.parallel_input = parallel_input
        self.process_group = resolve_group(process_group)
        names = ensure_tp_rng_states(self.process_group)
        self.rng_state_name = names.parallel if parallel_input else names.replicated

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        return deepcopy_sharing_group(self, memo)

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: GroupArg = None, **options: Any
    ) -> Dropout1D:
        """Build from an ``nn.Dropout`` (same ``p`` and ``inplace``; ``options``:
        ``parallel_input`` for :class:`Dropout1D`; ``process_group`` may be a one-element
        list)."""
        if not isinstance(module, nn.Dropout):
            raise TypeError(f"expected an nn.Dropout, got {type(module).__name__}.")
        return cls(module.p, module.inplace, process_group=process_group, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with get_tp_rng_tracker().fork(self.rng_state_name):
            return F.dropout(x, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parallel_input={self.parallel_input}"


class DropoutForParallelInput(Dropout1D):
    """:class:`Dropout1D` for sharded activations (independent masks per rank)."""

    def __init__(
        self, p: float = 0.5, inplace: bool = False, process_group: GroupArg = None
    ) -> None:
        super().__init__(p, inplace, parallel_input=True, process_group=process_group)


class DropoutForReplicatedInput(Dropout1D):
    """:class:`Dropout1D` for replicated activations (the same mask on every rank)."""

    def __init__(
        self, p: float = 0.5, inplace: bool = False, process_group: GroupArg = None
    ) -> None:
        super().__init__(p, inplace, parallel_input=False, process_group=process_group)
