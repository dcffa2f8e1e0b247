"""Chunk-size search: the chunk size that wastes the fewest elements for a model.

This is the search ``GeminiDDP`` runs (:func:`find_chunk_configuration`); Colossal-AI's
``search_chunk_configuration`` (its signature, algorithm and return value) is in
:mod:`~kolossos.zero.gemini.chunk.search_utils`.

Parameters are packed in initialisation order; a parameter that does not fit in the room left in
the current chunk opens a new one, and the room left behind is wasted. A tied parameter (one that
several modules register, as a tied embedding and LM head do) is packed alone in a chunk cut to its
size: it is used at both ends of the step, and chunk-mates would stay gathered with it.
Every candidate size in ``[min_chunk_size, min_chunk_size + search_range]`` on a grid of
``hidden_dim`` elements is simulated at once (vectorised over candidates), and the size with
the least waste wins (the smallest such size on a tie). The last chunk is cut to what it
holds, so only gaps count. Sizes are in elements; the ``_m`` arguments are in Mi-elements
(2**20), as in Colossal-AI.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "ChunkSearchResult",
    "find_chunk_configuration",
    "search_chunk_size",
    "tied_params",
    "unique_params",
]

_logger = logging.getLogger(__name__)
_MI = 2**20
DEFAULT_HIDDEN_DIM = 1024


@dataclass(frozen=True, kw_only=True)
class ChunkSearchResult:
    """What the search found (element counts)."""

    chunk_size: int
    """The chosen chunk size in elements."""
    used: int
    """Elements of parameters packed."""
    wasted: int
    """Elements of chunk room left empty by the packing."""
    seconds: float
    """Time the search took."""

    @property
    def wasted_percentage(self) -> float:
        """``wasted / (used + wasted)`` in percent."""
        total = self.used + self.wasted
        return 100.0 * self.wasted / total if total else 0.0

    def report(self) -> str:
        """The line Colossal-AI prints (numbers in Mi-elements)."""
        return (
            f"searching chunk configuration is completed in {self.seconds:.2f} s. "
            f"used number: {self.used / _MI:.2f} MB, wasted number: {self.wasted / _MI:.2f} MB, "
            f"total wasted percentage is {self.wasted_percentage:.2f}%"
        )


def unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` in initialisation (registration) order, each tied parameter once
    under its first name."""
    return list(module.named_parameters(remove_duplicate=True))


def tied_params(module: nn.Module) -> set[nn.Parameter]:
    """The parameters that more than one module registers (tied weights)."""
    seen: set[nn.Parameter] = set()  # tensors hash by identity
    tied: set[nn.Parameter] = set()
    for _, p in module.named_parameters(remove_duplicate=False):
        (tied if p in seen else seen).add(p)
    return tied


def _waste(numels: torch.Tensor, sizes: torch.Tensor, alone: Sequence[bool]) -> torch.Tensor:
    """Elements wasted by packing ``numels`` in order into chunks of each of ``sizes``; a
    parameter marked ``alone`` closes the open chunk and gets one cut to its size."""
    left = torch.zeros_like(sizes)
    waste = torch.zeros_like(sizes)
    for i, n in enumerate(numels.tolist()):
        if i < len(alone) and alone[i]:
            waste += left
            left = torch.zeros_like(sizes)
            continue
        fits = left >= n
        big = sizes < n  # an oversize parameter gets a chunk of its own size
        opened = ~fits
        waste += torch.where(opened, left, 0)
        left = torch.where(fits, left - n, torch.where(big, 0, sizes - n))
    return waste  # the last chunk is cut to its content: its room is not waste


def search_chunk_size(
    numels: Sequence[int],
    search_range: int,
    min_chunk_size: int,
    interval: int,
    alone: Sequence[bool] = (),
) -> tuple[int, int]:
    """``(chunk_size, wasted elements)`` for parameter sizes ``numels`` (in elements);
    ``alone[i]`` marks a parameter packed in a chunk of its own (a tied one).

    Raises:
        ValueError: for a negative range, a non-positive minimum or interval.
    """
    if search_range < 0 or min_chunk_size <= 0 or interval <= 0:
        raise ValueError(
            f"search_range={search_range}, min_chunk_size={min_chunk_size}, "
            f"interval={interval}: need search_range >= 0 and min_chunk_size, interval > 0."
        )
    total = sum(numels)
    if total <= min_chunk_size:  # everything fits in one chunk
        return max(total, 1), 0
    sizes = torch.arange(min_chunk_size, min_chunk_size + search_range + 1, interval)
    waste = _waste(torch.tensor(list(numels), dtype=torch.int64), sizes.to(torch.int64), alone)
    best = int(torch.argmin(waste))  # first minimum: the smallest size
    return int(sizes[best]), int(waste[best])


def find_chunk_configuration(
    model: nn.Module,
    search_range_m: float,
    min_chunk_size_m: float,
    hidden_dim: int | None = None,
    verbose: bool = False,
    **unsupported: Any,
) -> tuple[dict[str, Any], ChunkSearchResult]:
    """Find the chunk size for ``model`` (see the module docstring).

    Args:
        model: the model (parameters may live on the meta device).
        search_range_m: width of the searched range, in Mi-elements.
        min_chunk_size_m: smallest chunk size, in Mi-elements; a model smaller than it fits in
            one chunk.
        hidden_dim: grid step of the search in elements (default 1024); the model's hidden
            size makes the search faster and matches its matrices.
        verbose: log the report line.

    Returns:
        ``({"chunk_size": elements, "keep_gathered": False}, result)``.

    Example:
        >>> config, result = find_chunk_configuration(nn.Linear(64, 64), 1, 0.001)
        >>> config["chunk_size"]
        4160
    """
    if unsupported:
        raise NotImplementedError(
            f"find_chunk_configuration does not support {sorted(unsupported)}; remove them."
        )
    if hidden_dim is not None and (isinstance(hidden_dim, bool) or hidden_dim <= 0):
        raise ValueError(f"hidden_dim={hidden_dim!r} must be a positive int (e.g. n_embd).")
    start = time.perf_counter()
    params = [p for _, p in unique_params(model)]
    tied = tied_params(model)
    numels = [p.numel() for p in params]
    size, wasted = search_chunk_size(
        numels,
        int(search_range_m * _MI),
        max(1, int(min_chunk_size_m * _MI)),
        hidden_dim or DEFAULT_HIDDEN_DIM,
        [p in tied for p in params],
    )
    result = ChunkSearchResult(
        chunk_size=size, used=sum(numels), wasted=wasted, seconds=time.perf_counter() - start
    )
    if verbose:
        _logger.info(result.report())
    return {"chunk_size": size, "keep_gathered": False}, result
