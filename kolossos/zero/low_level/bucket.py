"""Gradient buckets: which flat ranges are reduced together, in which order, into which buffer.

A bucket is a contiguous range of one group's flat buffer that

* lies inside **one** partition, so exactly one rank (its owner) receives the reduced result and
  one reduce-to-owner call carries it;
* holds at most ``bucket_numel`` elements (parameters larger than that span several buckets);
* never covers the padding at the end of the flat buffer.

Buckets are numbered in launch order: groups from last to first, and inside a group from the end
of the flat buffer to its start, because backward produces the gradients of the last parameters
first. Every rank launches the buckets in this order whatever order its gradients arrive in, so
the collectives always match across ranks (as in ``DistributedDataParallel``).

Example:
    >>> layout = FlatLayout.of_shapes([(6,), (4,)], world_size=2)  # partitions [0, 5), [5, 10)
    >>> [(b.start, b.stop, b.owner) for b in plan_buckets([layout], bucket_numel=3)]
    [(7, 10, 1), (5, 7, 1), (2, 5, 0), (0, 2, 0)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["BucketPiece", "BucketSpec", "BufferPool", "buckets_of_params", "plan_buckets"]


@dataclass(frozen=True)
class BucketPiece:
    """The part of one parameter that falls into a bucket (flat coordinates of the group)."""

    param: int
    """index of the parameter in its group"""
    lo: int
    """first flat element"""
    hi: int
    """one past the last flat element"""


@dataclass(frozen=True)
class BucketSpec:
    """One gradient bucket (see the module doc)."""

    index: int
    """launch order"""
    group: int
    """parameter group"""
    start: int
    """first flat element of the group's buffer"""
    stop: int
    """one past the last flat element"""
    owner: int
    """the rank (of the data-parallel group) whose partition holds the range"""
    pieces: tuple[BucketPiece, ...]
    """the parameters overlapping the range"""

    @property
    def numel(self) -> int:
        """Elements in the bucket."""
        return self.stop - self.start


def plan_buckets(layouts: Sequence[FlatLayout], bucket_numel: int) -> list[BucketSpec]:
    """Cut every group's flat buffer into buckets, numbered in launch order.

    Args:
        layouts: one layout per parameter group (all with the same world size).
        bucket_numel: the largest bucket, in elements (>= 1).

    Raises:
        ValueError: ``bucket_numel < 1``.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be >= 1.")
    buckets: list[BucketSpec] = []
    for group in reversed(range(len(layouts))):
        layout = layouts[group]
        for rank in reversed(range(layout.world_size)):
            start, _ = layout.partition_range(rank)
            stop = start + layout.valid_numel(rank)
            while stop > start:
                lo = max(start, stop - bucket_numel)
                pieces = tuple(BucketPiece(s.index, a, b) for s, a, b in layout.spans_in(lo, stop))
                buckets.append(BucketSpec(len(buckets), group, lo, stop, rank, pieces))
                stop = lo
    return buckets


def buckets_of_params(
    buckets: Sequence[BucketSpec], num_params: Sequence[int]
) -> list[list[list[tuple[int, BucketPiece]]]]:
    """For each group and parameter, the ``(bucket index, piece)`` pairs it contributes to."""
    table: list[list[list[tuple[int, BucketPiece]]]] = [[[] for _ in range(n)] for n in num_params]
    for bucket in buckets:
        for piece in bucket.pieces:
            table[bucket.group][piece.param].append((bucket.index, piece))
    return table


class BufferPool:
    """Reusable 1-D buffers (one dtype and device), handed out as ``[:numel]`` views.

    Bucket and receive buffers are needed for every backward; keeping a few alive avoids
    re-allocating (and page-faulting) tens of MiB per bucket per step.

    Args:
        capacity: elements of each buffer (the largest request).
        dtype: element type.
        device: where the buffers live.
    """

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self._free: list[torch.Tensor] = []

    def acquire(self, numel: int) -> torch.Tensor:
        """A buffer view of ``numel`` elements with undefined content."""
        assert numel <= self.capacity, f"{numel} > pool capacity {self.capacity}"
        base = (
            self._free.pop()
            if self._free
            else torch.empty(self.capacity, dtype=self.dtype, device=self.device)
        )
        return base[:numel]

    def release(self, view: torch.Tensor) -> None:
        """Give a buffer (any view of it) back."""
        base = view._base if view._base is not None else view
        self._free.append(base)

    def clear(self) -> None:
        """Free every idle buffer."""
        self._free.clear()
