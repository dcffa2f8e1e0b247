"""The flat-buffer layout of one parameter group, and which rank owns which part of it.

Every parameter group the optimizer manages gets one flat buffer. Its layout:

* parameters in the order of the group (``param_groups[g]["params"]``), each flattened
  (``view(-1)``) and placed right after the previous one, without gaps;
* then ``padding`` zero elements at the **end**, the fewest that make the length a multiple of the
  data-parallel size ``N``;
* rank ``r`` owns the ``r``-th of the ``N`` equal partitions: ``[r * S, (r + 1) * S)`` with
  ``S = padded_numel / N``. A parameter may straddle two (or more) partitions.

The layout is pure arithmetic (no tensors), so it is cheap to test and identical on every rank.

Example:
    >>> layout = FlatLayout.of_shapes([(3, 2), (5,)], world_size=4)
    >>> layout.numel, layout.padded_numel, layout.partition_numel
    (11, 12, 3)
    >>> layout.owners(4, 9)  # flat range [4, 9) lies in partitions 1, 2 and the start of 3
    [(1, 4, 6), (2, 6, 9)]
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["FlatLayout", "ParamSpan", "intersect"]


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The intersection of two half-open ranges, or ``None`` when it is empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter lives in its group's flat buffer."""

    index: int
    """position of the parameter in its group"""
    offset: int
    """first flat element"""
    numel: int
    """number of elements"""
    shape: tuple[int, ...]
    """the parameter's shape"""

    @property
    def stop(self) -> int:
        """One past the last flat element."""
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """The flat layout of one parameter group over ``world_size`` partitions (module doc)."""

    spans: tuple[ParamSpan, ...]
    """one entry per parameter, in group order"""
    world_size: int
    """N, the number of partitions"""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1.")
        expected = 0
        for position, span in enumerate(self.spans):
            assert span.index == position and span.offset == expected, "spans must be contiguous"
            expected = span.stop

    @classmethod
    def of_shapes(cls, shapes: Iterable[Sequence[int]], world_size: int) -> FlatLayout:
        """Lay parameters of these shapes out one after the other."""
        spans, offset = [], 0
        for index, shape in enumerate(shapes):
            numel = math.prod(shape)
            spans.append(ParamSpan(index, offset, numel, tuple(int(d) for d in shape)))
            offset += numel
        return cls(spans=tuple(spans), world_size=world_size)

    @property
    def numel(self) -> int:
        """T: elements of all parameters (no padding)."""
        return self.spans[-1].stop if self.spans else 0

    @property
    def padded_numel(self) -> int:
        """T rounded up to a multiple of N (the flat buffer's length)."""
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def padding(self) -> int:
        """Zero elements at the end of the flat buffer."""
        return self.padded_numel - self.numel

    @property
    def partition_numel(self) -> int:
        """S: elements per partition (padding included)."""
        return self.padded_numel // self.world_size

    def partition_range(self, rank: int) -> tuple[int, int]:
        """Flat range ``[start, stop)`` of rank ``rank``'s partition (padding included)."""
        self._check_rank(rank)
        size = self.partition_numel
        return rank * size, (rank + 1) * size

    def valid_numel(self, rank: int) -> int:
        """Elements of rank ``rank``'s partition that belong to parameters (padding excluded)."""
        start, stop = self.partition_range(rank)
        return max(0, min(stop, self.numel) - start)

    def owner_of(self, position: int) -> int:
        """The rank owning flat element ``position``."""
        if not 0 <= position < self.padded_numel:
            raise IndexError(f"flat position {position} outside [0, {self.padded_numel}).")
        return position // self.partition_numel

    def owners(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Split the flat range ``[start, stop)`` by owner: ``[(rank, lo, hi), ...]`` in order."""
        pieces = []
        position = start
        while position < stop:
            rank = self.owner_of(position)
            hi = min(stop, (rank + 1) * self.partition_numel)
            pieces.append((rank, position, hi))
            position = hi
        return pieces

    def spans_in(self, start: int, stop: int) -> list[tuple[ParamSpan, int, int]]:
        """The parameters overlapping ``[start, stop)``, with the overlap ``(span, lo, hi)``."""
        found = []
        first = max(0, bisect.bisect_right(self._offsets, start) - 1)
        for span in self.spans[first:]:
            if span.offset >= stop:
                break
            piece = intersect((span.offset, span.stop), (start, stop))
            if piece is not None:
                found.append((span, piece[0], piece[1]))
        return found

    @functools.cached_property
    def _offsets(self) -> list[int]:
        return [span.offset for span in self.spans]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside [0, {self.world_size}).")
