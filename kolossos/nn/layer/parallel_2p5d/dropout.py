"""Dropout on 2.5D activation blocks (each rank holds a different block, so masks are drawn
independently per rank, on the tensor group's per-rank random stream)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d.random import ensure_tp_rng_states, get_tp_rng_tracker
from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D

__all__ = ["Dropout2p5D"]


class Dropout2p5D(nn.Dropout):
    """``nn.Dropout`` whose mask comes from the tesseract's random streams (see
    :mod:`kolossos.nn.layer.parallel_1d.random`: reproduced under activation checkpointing).

    Args:
        p: drop probability.
        inplace: as in ``nn.Dropout``.
        parallel_input: the input is an activation block, different on every rank (independent
            masks, the default); ``False``: the input is identical on every rank of the tensor
            group (identical masks).
        groups: the tesseract's groups.
        rng_context: a factory of the context to draw the mask in (e.g. Colossal-AI's
            ``lambda: seed(ParallelMode.TENSOR)``), instead of the tracker's stream.

    Example:
        >>> drop = Dropout2p5D(0.1, groups=groups)  # doctest: +SKIP
    """

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        parallel_input: bool = True,
        groups: Groups2p5D,
        rng_context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        super().__init__(p, inplace)
        self.groups, self.parallel_input = groups, parallel_input
        self.rng_context = rng_context
        names = ensure_tp_rng_states(groups.tensor)
        self.rng_state_name = names.parallel if parallel_input else names.replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        context = self.rng_context
        with context() if context is not None else get_tp_rng_tracker().fork(self.rng_state_name):
            return F.dropout(x, self.p, True, self.inplace)
