"""Which chunks to move between device and host: pure decisions over chunk ids and byte counts.

Gemini's eviction rule is Belady's optimal cache policy adapted to training. Training repeats the
same sequence of compute moments every iteration, so the order in which chunks were used during
warm-up (an :class:`AccessTrace`) tells, at any moment, when each chunk will be needed next. When
the chunks about to be computed do not fit next to the ones already on the device, the resident
chunk whose next use is *latest* leaves first. Nothing here touches tensors: the policies in
``auto.py`` and ``static.py`` turn a :class:`LayoutPlan` into moves, and the unit tests replay
synthetic traces through :func:`plan_layout`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kolossos.zero.gemini.memory_tracer.trace import NEVER, AccessTrace

__all__ = [
    "NEVER",
    "AccessTrace",
    "ChunkView",
    "DeviceBudgetExceededError",
    "LayoutPlan",
    "plan_layout",
]


class DeviceBudgetExceededError(RuntimeError):
    """The chunks one compute moment needs do not fit in the device memory left for model data."""


@dataclass(frozen=True, kw_only=True)
class ChunkView:
    """What the planner needs to know about one chunk.

    Attributes:
        chunk_id: the chunk's id.
        on_device: whether the chunk's home (its shard) is on the compute device now.
        device_bytes: bytes the chunk occupies on the device now: its shard there, plus its
            payload while gathered (a gathered payload is always on the device).
        compute_bytes: bytes it occupies on the device while computing, once loaded.
        evict_bytes: bytes that moving it to the host frees (its shard; a gathered payload stays
            until the chunk is released).
        movable: whether it may be moved to the host now (not in use, not kept gathered).
    """

    chunk_id: int
    on_device: bool
    device_bytes: int
    compute_bytes: int = 0
    evict_bytes: int = 0
    movable: bool = True


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """Moves that make one compute moment fit in the device memory for model data.

    Attributes:
        evict: ids of chunks to move device -> host, first victim first.
        load: ids of needed chunks to move host -> device, in the order they were needed.
        device_bytes_after: model-data bytes on the device once the moves are done and the
            needed chunks are gathered.
    """

    evict: tuple[int, ...]
    load: tuple[int, ...]
    device_bytes_after: int


def _victim_order(candidates: Sequence[ChunkView], priority: Mapping[int, int]) -> list[ChunkView]:
    """Candidates sorted best victim first: latest next use, then larger, then lower id."""
    return sorted(
        candidates,
        key=lambda c: (-priority.get(c.chunk_id, NEVER), -c.evict_bytes, c.chunk_id),
    )


def _choose_victims(ordered: Sequence[ChunkView], to_free: int) -> list[ChunkView]:
    """Take victims in order until ``to_free`` bytes are freed, then give back needless ones.

    The second pass keeps (from the victim with the earliest next use backwards) every victim
    whose bytes are not needed once the others have gone, so no chunk moves without need.
    """
    victims: list[ChunkView] = []
    freed = 0
    for chunk in ordered:
        if freed >= to_free:
            break
        victims.append(chunk)
        freed += chunk.evict_bytes
    for chunk in reversed(list(victims)):
        if freed - chunk.evict_bytes >= to_free:
            victims.remove(chunk)
            freed -= chunk.evict_bytes
    return victims


def plan_layout(
    *,
    needed: Sequence[ChunkView],
    resident: Sequence[ChunkView],
    capacity: int,
    priority: Mapping[int, int],
) -> LayoutPlan:
    """Plan the moves that fit ``needed`` chunks on the device within ``capacity`` bytes.

    Args:
        needed: the chunks about to be computed; they end up on the device, gathered.
        resident: the other chunks holding device memory: those at home on the device, and
            gathered ones (whose payload is on the device even when their home is the host).
        capacity: bytes of device memory model data may use during this moment.
        priority: per chunk id, larger = evict earlier (e.g. :meth:`AccessTrace.victim_priority`).
            Ties go to the larger chunk, then the lower id, so plans are deterministic.

    Returns:
        The plan; ``evict`` is empty when everything fits already.

    Raises:
        DeviceBudgetExceededError: even after evicting every movable resident chunk, the needed
            chunks do not fit in ``capacity``.
    """
    needed_ids = {c.chunk_id for c in needed}
    others = [c for c in resident if c.chunk_id not in needed_ids]
    need_bytes = sum(c.compute_bytes for c in needed)
    used = need_bytes + sum(c.device_bytes for c in others)
    to_free = used - capacity
    victims: list[ChunkView] = []
    if to_free > 0:
        candidates = [c for c in others if c.movable and c.evict_bytes > 0]
        if sum(c.evict_bytes for c in candidates) < to_free:
            pinned = used - need_bytes - sum(c.evict_bytes for c in candidates)
            raise DeviceBudgetExceededError(
                f"the chunks needed now take {need_bytes} bytes and resident data that cannot move "
                f"{pinned} bytes, but only {capacity} bytes of device memory are available for "
                "model data. Raise device_memory_budget (or the accelerator memory), lower "
                "warmup_non_model_data_ratio or gpu_margin_mem_ratio, or use smaller chunks "
                "(search_range_m / min_chunk_size_m)."
            )
        victims = _choose_victims(_victim_order(candidates, priority), to_free)
    load = tuple(c.chunk_id for c in needed if not c.on_device)
    freed = sum(c.evict_bytes for c in victims)
    return LayoutPlan(
        evict=tuple(c.chunk_id for c in victims), load=load, device_bytes_after=used - freed
    )
