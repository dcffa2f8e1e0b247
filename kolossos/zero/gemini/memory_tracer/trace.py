"""``AccessTrace``: the chunks used at each compute moment of one training iteration, recorded
in warm-up, and the next-use queries Gemini's eviction rule (:mod:`~kolossos.zero.gemini.placement.
eviction`) asks of it."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Collection, Sequence

__all__ = ["NEVER", "AccessTrace"]

#: next-use distance of a chunk that the trace never uses (evicted before any other)
NEVER = 1 << 62


class AccessTrace:
    """The chunk ids used at each compute moment of one training iteration.

    Args:
        order: ``order[m]`` holds the ids of the chunks computed at moment ``m``.

    Example:
        >>> trace = AccessTrace([[0], [1], [2], [1], [0]])
        >>> trace.next_use(1, 1)  # chunk 1 is used again at moment 3
        2
        >>> trace.next_use(2, 2)  # next used at moment 2 of the next iteration
        5
    """

    def __init__(self, order: Sequence[Collection[int]]) -> None:
        self._length = len(order)
        uses: defaultdict[int, list[int]] = defaultdict(list)
        for moment, ids in enumerate(order):
            for chunk_id in sorted(set(ids)):
                uses[chunk_id].append(moment)
        self._uses = dict(uses)

    def __len__(self) -> int:
        return self._length

    def next_use(self, chunk_id: int, moment: int) -> int:
        """Return how many moments after ``moment`` the chunk is used next (cyclically).

        A chunk not used again in this iteration is next used at its first moment of the next
        iteration. Moments beyond the trace are read modulo its length.

        Returns:
            A distance >= 1, or :data:`NEVER` for a chunk that the trace never uses.
        """
        uses = self._uses.get(chunk_id)
        if not uses or self._length == 0:
            return NEVER
        here = moment % self._length
        index = bisect.bisect_right(uses, here)
        upcoming = uses[index] if index < len(uses) else uses[0] + self._length
        return upcoming - here

    def victim_priority(self, moment: int, chunk_ids: Collection[int]) -> dict[int, int]:
        """Return each chunk's next-use distance: the larger, the earlier it should be evicted."""
        return {chunk_id: self.next_use(chunk_id, moment) for chunk_id in chunk_ids}
