"""Rank ↔ coordinate arithmetic of an N-dimensional process mesh (row-major, last axis fastest).

Pure functions, so every rule is unit-testable without a process group.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def validate_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Check a mesh shape: a non-empty sequence of positive integers.

    Raises:
        ValueError: empty, or a size that is not a positive integer.
    """
    dims = tuple(shape)
    if not dims:
        raise ValueError("a process mesh needs at least one axis, e.g. ProcessGroupMesh(4).")
    for axis, size in enumerate(dims):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {axis} has size {size!r}; every size must be an int >= 1.")
    return dims


def ravel(coord: Sequence[int], shape: Sequence[int]) -> int:
    """The rank at ``coord`` in a mesh of ``shape``."""
    if len(coord) != len(shape):
        raise ValueError(f"coordinate {tuple(coord)} has {len(coord)} axes, mesh has {len(shape)}.")
    rank = 0
    for c, size in zip(coord, shape, strict=True):
        if not 0 <= c < size:
            raise ValueError(f"coordinate {tuple(coord)} lies outside mesh {tuple(shape)}.")
        rank = rank * size + c
    return rank


def unravel(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinate of ``rank`` in a mesh of ``shape``."""
    total = math.prod(shape)
    if not 0 <= rank < total:
        raise ValueError(f"rank {rank} lies outside a mesh of {total} processes {tuple(shape)}.")
    coord = []
    for size in reversed(shape):
        rank, c = divmod(rank, size)
        coord.append(c)
    return tuple(reversed(coord))


def normalize_axes(axes: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """Sorted, de-duplicated, non-negative axis indices.

    Raises:
        ValueError: an axis out of range, or a repeated axis.
    """
    items = (axes,) if isinstance(axes, int) else tuple(axes)
    if not items:
        raise ValueError("at least one axis is needed to form a process group.")
    out = []
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a mesh with {ndim} axes.")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axes {items} name the same axis twice.")
    return tuple(sorted(out))


def group_ranks(coord: Sequence[int], shape: Sequence[int], axes: Sequence[int]) -> list[int]:
    """Ranks sharing ``coord`` on every axis outside ``axes`` (the group of ``coord`` along them),
    in ascending order."""
    ranges = [range(size) if i in axes else (coord[i],) for i, size in enumerate(shape)]
    return sorted(ravel(c, shape) for c in itertools.product(*ranges))


def all_groups(shape: Sequence[int], axes: Sequence[int]) -> list[list[int]]:
    """Every group along ``axes``, ordered by the coordinates of the other axes.

    Every rank must create the groups in this same order (``new_group`` is collective).
    """
    others = [range(size) if i not in axes else (0,) for i, size in enumerate(shape)]
    return [group_ranks(c, shape, axes) for c in itertools.product(*others)]
