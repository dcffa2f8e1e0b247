"""Dropout on 3D-parallel activations (:class:`Dropout3D`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d.random import ensure_tp_rng_states, get_tp_rng_tracker
from kolossos.nn.layer.parallel_3d._base import check_groups
from kolossos.nn.layer.parallel_3d.groups import Groups3D

__all__ = ["Dropout3D"]


class Dropout3D(nn.Dropout):
    """``nn.Dropout`` on a ``(batch/q**2, ..., features/q)`` block: each rank of the cube holds
    different elements, so each draws an independent mask, from the cube's per-rank stream of
    :func:`~kolossos.nn.layer.parallel_1d.random.get_tp_rng_tracker` (derived from the default
    generator: reproduced under activation checkpointing).

    Args:
        p: drop probability.
        inplace: as in ``nn.Dropout``.
        groups: the groups of the input's layout (keyword-only).

    Example:
        >>> drop = Dropout3D(0.1, groups=groups)  # doctest: +SKIP
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, groups: Groups3D) -> None:
        super().__init__(p, inplace)
        self.groups = check_groups("Dropout3D", groups)
        self.rng_state_name = ensure_tp_rng_states(self.groups.tensor).parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with get_tp_rng_tracker().fork(self.rng_state_name):
            return F.dropout(x, self.p, True, self.inplace)
