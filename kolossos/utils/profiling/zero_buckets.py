"""LowLevelZero's gradient buffers during backward, replayed without tensors.

:class:`~kolossos.zero.low_level.reducer.GradientReducer` cuts the flat gradient space into
buckets (each inside one rank's partition, launched in a fixed order from the end of the flat
buffer), stages gradients into pooled bucket buffers as they arrive, launches a bucket once all
its gradients are there (and every earlier bucket was launched), and keeps at most two buckets in
flight. Pooled buffers are reused and freed only when backward ends; ZeRO-2's gradient partition
is allocated by the first gradient that reaches it. How many buffers exist at a given moment
therefore depends on the order gradients arrive in (backward runs the blocks from the last to the
first; a tied embedding's gradient arrives last) and on where the buckets' boundaries fall.
:func:`zero_buffers` replays that, rank by rank, and reports the buffers alive at three moments.

Assumptions: a launched bucket's communication is complete at the next gradient's arrival (the
ranks reach the same bucket together), and the reducer sees it then, except for gloo's
point-to-point transfers (``pairwise``), which report completion only once waited for: their
buffers are given back when the reducer waits, i.e. when a third bucket needs a buffer or
backward ends; communication in the working dtype.

Example:
    >>> buf = zero_buffers([100, 50, 50], [2, 1, 0], world_size=2, bucket_numel=60, stage=2,
    ...                    pairwise=True, inside_after=2)
    >>> buf.after, buf.partition_end  # three 60-element buffers (gloo's sends not waited for)
    (180, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ZeroBuffers", "plan_bucket_ranges", "zero_buffers"]

#: buckets in flight before a new buffer makes the reducer wait for the oldest
MAX_IN_FLIGHT = 2


def plan_bucket_ranges(
    total: int, world_size: int, bucket_numel: int
) -> list[tuple[int, int, int]]:
    """``(start, stop, owner)`` of every bucket of one flat buffer of ``total`` elements, in
    launch order (``kolossos.zero.low_level.bucket.plan_buckets`` for one group)."""
    part = -(-total // world_size)
    out = []
    for rank in reversed(range(world_size)):
        start = rank * part
        stop = min(start + part, total)
        while stop > start:
            lo = max(start, stop - bucket_numel)
            out.append((lo, stop, rank))
            stop = lo
    return out


@dataclass(frozen=True)
class ZeroBuffers:
    """Elements of bucket buffers, and whether ZeRO-2's gradient partition exists, on the rank
    with the most, at three moments of backward."""

    inside: int
    """bucket buffers inside backward: the most (counting the partition) at any gradient's
    arrival from the last block's last one up to the embedding's"""
    end: int
    """bucket buffers when the last gradient (the embedding's) arrives"""
    after: int
    """bucket buffers once every bucket is launched (all are freed right after)"""
    partition_inside: bool
    """the gradient partition exists at :attr:`inside` (on that rank)"""
    partition_end: bool
    """the gradient partition exists at :attr:`end`"""


class _Rank:
    """One rank's reducer, replayed."""

    def __init__(self, rank: int, buckets: list[tuple[int, int, int]], part: int, stage: int,
                 pairwise: bool) -> None:  # fmt: skip
        self.rank, self.buckets, self.stage, self.pairwise = rank, buckets, stage, pairwise
        self.capacity = max((b[1] - b[0] for b in buckets), default=0)
        self.part = part
        self.allocated = self.free = 0
        self.store = False
        self.staged: set[int] = set()
        self.inflight: list[int] = []  # buffers held by each flight
        self.next = 0

    def now(self) -> tuple[int, bool]:
        return self.allocated * self.capacity, self.store

    def _acquire(self) -> None:
        while len(self.inflight) >= MAX_IN_FLIGHT:
            self.free += self.inflight.pop(0)
        if self.free:
            self.free -= 1
        else:
            self.allocated += 1

    def _owner_direct(self, b: int) -> bool:
        return self.stage == 2 and self.pairwise and self.buckets[b][2] == self.rank

    def stage_piece(self, b: int) -> None:
        if self.stage != 2:
            return
        if self._owner_direct(b):
            self.store = True
        elif b not in self.staged:
            self.staged.add(b)
            self._acquire()

    def launch(self, b: int) -> None:
        owner = self.buckets[b][2] == self.rank
        held = 0
        if self._owner_direct(b):
            self._acquire()
            held = 1
        elif self.stage == 2:
            if b in self.staged:
                self.staged.discard(b)
            else:
                self._acquire()
            held = 1
            self.store = self.store or owner
        elif owner and self.pairwise:  # ZeRO-1: the owner's receive scratch
            self._acquire()
            held = 1
        self.inflight.append(held)

    def poll(self) -> None:
        self.free += sum(self.inflight)
        self.inflight.clear()


def _pieces(offsets: list[int], sizes: Sequence[int], buckets: list[tuple[int, int, int]],
            index: int) -> list[int]:  # fmt: skip
    lo, hi = offsets[index], offsets[index] + sizes[index]
    return [b for b, (start, stop, _) in enumerate(buckets) if start < hi and lo < stop]


def zero_buffers(
    sizes: Sequence[int],
    arrival: Sequence[int],
    world_size: int,
    bucket_numel: int,
    stage: int,
    pairwise: bool,
    inside_after: int = 1,
) -> ZeroBuffers:
    """Replay the reducer of every rank (at most 16, spread over the group) for tensors of
    ``sizes`` (registration order) whose gradients arrive in the order ``arrival``.

    Args:
        sizes: elements per tensor, in flat-buffer order.
        arrival: tensor indices in the order their gradients are final.
        world_size: data-parallel ranks.
        bucket_numel: the largest bucket (``reduce_bucket_size``).
        stage: 1 or 2.
        pairwise: two gloo ranks (owners receive into a buffer; ZeRO-2 owners keep their own
            part in the partition directly).
        inside_after: how many gradients have arrived at the :attr:`ZeroBuffers.inside` moment.
    """
    total = sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    padded = -(-total // world_size) * world_size
    buckets = plan_bucket_ranges(total, world_size, bucket_numel)
    of_param = [_pieces(offsets, sizes, buckets, i) for i in range(len(sizes))]
    step = max(1, world_size // 16)
    part = padded // world_size
    weigh = lambda m: m[0] + (part if m[1] else 0)  # noqa: E731
    inside, end, after = (0, False), (0, False), 0
    for r in range(0, world_size, step):
        sim = _Rank(r, buckets, padded // world_size, stage, pairwise)
        pending = [0] * len(buckets)
        for i in range(len(sizes)):
            for b in of_param[i]:
                pending[b] += 1
        marks = []
        for count, i in enumerate(arrival):
            if count == len(arrival) - 1:
                end = max(end, sim.now(), key=weigh)
            for b in of_param[i]:
                sim.stage_piece(b)
                pending[b] -= 1
            while sim.next < len(buckets) and pending[sim.next] == 0:
                sim.launch(sim.next)
                sim.next += 1
            marks.append(sim.now())
            if not pairwise:  # gloo's isend/irecv works are not completed until waited for
                sim.poll()
        if marks:
            first = min(len(marks), max(inside_after, 1)) - 1
            for mark in marks[first : max(first + 1, len(marks) - 1)]:
                inside = max(inside, mark, key=weigh)
        while sim.next < len(buckets):
            sim.launch(sim.next)
            sim.next += 1
        after = max(after, sim.now()[0])
    return ZeroBuffers(inside=inside[0], end=end[0], after=after, partition_inside=inside[1],
                       partition_end=end[1])  # fmt: skip
