"""Dropout under 2D tensor parallelism: every rank holds a different block of the activations,
so every rank draws an independent mask.

By default the mask comes from a per-rank stream of the tensor-parallel random tracker
(:mod:`kolossos.nn.layer.parallel_1d.random`): derived from the default generator (so
``torch.utils.checkpoint`` reproduces it) and salted with the rank's global rank. The legacy
facade passes ``rng_context`` instead, Colossal-AI's ``seed(ParallelMode.TENSOR)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d.random import get_tp_rng_tracker
from kolossos.nn.layer.parallel_2d._base import ParallelModule2D
from kolossos.nn.layer.parallel_2d.grid import Groups2D

__all__ = ["Dropout2D", "ensure_2d_rng_stream"]

RngContext = Callable[[], AbstractContextManager[Any]]
"""A zero-argument callable returning the context manager a mask is drawn under."""


def ensure_2d_rng_stream(groups: Groups2D, seed: int = 0) -> str:
    """Register (once) and return the name of this rank's independent dropout stream for the
    grid of ``groups`` (no communication).

    Example:
        >>> with get_tp_rng_tracker().fork(ensure_2d_rng_stream(groups)):  # doctest: +SKIP
        ...     y = F.dropout(x_ij, 0.1)
    """
    key = f"{','.join(map(str, groups.row_ranks))}|{','.join(map(str, groups.col_ranks))}"
    name = f"tp2d-parallel[{key}]"
    digest = hashlib.blake2b(f"2d:{seed}:{dist.get_rank()}".encode(), digest_size=8).digest()
    get_tp_rng_tracker().add(name, int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return name


class Dropout2D(ParallelModule2D, nn.Dropout):
    """``nn.Dropout`` on a 2D activation block, with an independent mask per rank.

    Args:
        p: drop probability.
        inplace: as in ``nn.Dropout``.
        groups: the grid.
        rng_context: ``rng_context()`` gives the context manager the mask is drawn under;
            ``None``: this rank's stream of the tensor-parallel tracker
            (:func:`ensure_2d_rng_stream`).

    Example:
        >>> drop = Dropout2D(0.1, groups=groups)  # doctest: +SKIP
        >>> drop(x_ij).shape == x_ij.shape  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        groups: Groups2D,
        rng_context: RngContext | None = None,
    ) -> None:
        super().__init__(p, inplace)
        self._init_groups(groups)
        if rng_context is not None and not callable(rng_context):
            raise TypeError(
                f"Dropout2D: rng_context={rng_context!r} must be a callable returning a context "
                "manager (e.g. lambda: seed(ParallelMode.TENSOR)), or None."
            )
        self.rng_context = rng_context
        self.rng_state_name = None if rng_context is not None else ensure_2d_rng_stream(groups)

    def _context(self) -> AbstractContextManager[Any]:
        if self.rng_context is not None:
            return self.rng_context()
        assert self.rng_state_name is not None
        return get_tp_rng_tracker().fork(self.rng_state_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self._context():
            return F.dropout(x, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, q={self.groups.q}"
