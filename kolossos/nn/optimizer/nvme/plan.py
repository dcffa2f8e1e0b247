"""Which optimizer states go to disk, and where each lands in the swap file.

Pure bookkeeping, no I/O: parameters are picked greedily in parameter-group order until the
offloaded share of CPU parameter elements reaches ``nvme_offload_fraction``; their flattened
element ranges are then packed into *units* of at most ``unit_numel`` elements. A unit is what
the offloader streams: one read, one update, one write. Large parameters are split across units
at multiples of :data:`ALIGN` elements, so a split never changes which elements the vectorised
kernel handles in its scalar tail (results stay bitwise identical to the resident update).
Units never cross parameter groups (groups have different hyper-parameters) or state dtypes.

In a unit of ``n`` elements and ``k`` states (exp_avg, exp_avg_sq[, max_exp_avg_sq]) of
``itemsize`` bytes, state ``j`` occupies bytes ``[j*n*itemsize, (j+1)*n*itemsize)`` and a
segment's slice of it starts ``segment.offset`` elements into that block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ALIGN", "Segment", "Unit", "plan_units", "select_offloaded"]

#: split points inside a parameter fall on multiples of this many elements
ALIGN = 1 << 16


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of one flattened parameter, at ``offset`` inside its unit."""

    param: int
    """index into the offloader's list of offloaded parameters"""
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.stop - self.start


@dataclass
class Unit:
    """A run of segments streamed together (one read, one update, one write)."""

    group: int
    """parameter-group index"""
    dtype: torch.dtype
    """dtype of the states"""
    num_states: int
    segments: list[Segment] = field(default_factory=list)
    numel: int = 0
    file_offset: int = 0
    """byte offset in the swap file"""
    initialized: bool = False
    """False until first written: a fresh unit is zero-filled in memory instead of read"""

    @property
    def nbytes(self) -> int:
        """Bytes of all its states."""
        return self.numel * self.num_states * self.dtype.itemsize

    def state_block(self, j: int) -> tuple[int, int]:
        """Byte range ``(begin, end)`` of state ``j`` inside the unit."""
        size = self.numel * self.dtype.itemsize
        return j * size, (j + 1) * size


def select_offloaded(candidates: Sequence[tuple[int, bool]], fraction: float) -> list[bool]:
    """Greedy choice of the parameters whose states are offloaded.

    Args:
        candidates: per parameter, in order, ``(numel, eligible)``; eligible parameters live on the
            CPU and are contiguous. Only they count towards the total.
        fraction: share of the eligible elements to offload, in ``[0, 1]``.

    Returns:
        One flag per parameter.

    Example:
        >>> select_offloaded([(10, True), (30, True), (60, True)], 0.5)
        [True, True, False]
    """
    total = sum(n for n, ok in candidates if ok)
    budget = fraction * total
    taken, flags = 0, []
    for numel, eligible in candidates:
        take = eligible and numel > 0 and taken + numel <= budget
        taken += numel if take else 0
        flags.append(take)
    return flags


def plan_units(
    params: Sequence[tuple[int, int, torch.dtype]], num_states: int, unit_numel: int
) -> list[Unit]:
    """Pack offloaded parameters into units and lay the units out in the swap file.

    Args:
        params: per offloaded parameter, in order, ``(group index, numel, state dtype)``.
        num_states: states per element (2 for Adam, 3 with AMSGrad).
        unit_numel: the most elements in one unit (rounded down to a multiple of :data:`ALIGN`,
            at least ``ALIGN``).

    Example:
        >>> units = plan_units([(0, 100_000, torch.float32)], 2, 65536)
        >>> [(u.numel, u.file_offset) for u in units]
        [(65536, 0), (34464, 524288)]
    """
    cap = max(ALIGN, unit_numel // ALIGN * ALIGN)
    units: list[Unit] = []
    current: Unit | None = None
    for index, (group, numel, dtype) in enumerate(params):
        start = 0
        while start < numel:
            if current is None or current.group != group or current.dtype != dtype:
                current = _new_unit(units, group, dtype, num_states)
            room = cap - current.numel
            take = numel - start
            if take > room:  # split: the piece must end on an aligned element of the parameter
                take = room // ALIGN * ALIGN
                if take == 0:
                    current = _new_unit(units, group, dtype, num_states)
                    continue
            current.segments.append(Segment(index, start, start + take, current.numel))
            current.numel += take
            start += take
            if current.numel >= cap:
                current = None
    offset = 0
    for unit in units:
        unit.file_offset = offset
        offset += _round_up(unit.nbytes, 4096)  # page-aligned units
    return units


def _new_unit(units: list[Unit], group: int, dtype: torch.dtype, num_states: int) -> Unit:
    unit = Unit(group=group, dtype=dtype, num_states=num_states)
    units.append(unit)
    return unit


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
