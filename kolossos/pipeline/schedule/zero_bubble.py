"""Zero-bubble tables: the backward split into an input-gradient part ``B`` (on the critical
path: the previous stage waits for it) and a weight-gradient part ``W`` (needed only by the
optimizer step), with the ``W`` parts moved into the pipeline's idle slots.

* ``zbh1`` (ZB-H1), closed form: 1F1B's order of ``F`` and ``B``; rank ``r`` runs the ``W`` of
  micro-batch ``i - r`` right after the ``B`` of micro-batch ``i`` and its last ``r`` ``W`` parts
  at the end, where they fill the cool-down bubble. Every rank then holds at most ``p``
  micro-batches (1F1B's peak, on rank 0) and the bubble is ``(p-1)/(3m+p-1)`` with
  ``F = B = W``, a third of 1F1B's.
* ``zbv`` (ZB-V): two chunks per rank in the ``v`` layout, from a small list scheduler (a pure
  function): it plays the pipeline in modelled time (``F = B = W = 1``, the case the zero-bubble
  paper designs for) and, whenever a rank is free, starts its most urgent ready action: a ``B``
  first (it unblocks the previous stage), then an ``F`` if the rank still has room for one more
  chunk-micro-batch's activations (at most ``2p``: the activations of ``p`` whole-rank
  micro-batches, 1F1B's rank-0 peak), then a ``W`` (it unblocks nobody, so it fills gaps). With
  equal costs the only idle time left is the ``r`` units rank ``r`` waits for its first input:
  the makespan is the lower bound ``6m + p - 1``.

Pure functions, registered in :mod:`kolossos.pipeline.schedule.registry`; the runners are in
:mod:`kolossos.pipeline.schedule.zero_bubble_schedules`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kolossos.pipeline.schedule.table import (
    Action,
    ActionKind,
    ScheduleTable,
    dependencies,
)

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
Key = Callable[[Action, int], tuple[float, ...]]
_KIND_ORDER = {B: 0, F: 1, W: 2}


def _zb_priority(action: Action, stage: int) -> tuple[int, ...]:
    """Most urgent first: B, then F, then W; within a kind the oldest micro-batch, then the
    deeper stage for backwards and the shallower one for forwards."""
    depth = -stage if action.kind is not F else stage
    return (_KIND_ORDER[action.kind], action.microbatch, depth)


def list_schedule(
    *,
    name: str,
    pp_size: int,
    num_chunks: int,
    num_microbatches: int,
    layout: str,
    memory_limit: Sequence[int],
    costs: tuple[float, float, float] = (1.0, 1.0, 1.0),
    priority: Key = _zb_priority,
) -> ScheduleTable:
    """A split-backward table by greedy list scheduling in modelled time.

    Args:
        name: the table's name.
        pp_size: pipeline ranks.
        num_chunks: chunks per rank.
        num_microbatches: micro-batches per step.
        layout: stage placement (``loop`` or ``v``).
        memory_limit: per rank, the most chunk-micro-batches whose activations may be alive (from
            the start of their ``F`` to the end of their ``W``).
        costs: modelled ``(F, B, W)`` durations.
        priority: sort key of ready actions (smallest first), given the action and its stage.

    Raises:
        ValueError: the memory limits leave no way to finish (e.g. a limit below 1).
    """
    shape = dict(name=name, pp_size=pp_size, num_chunks=num_chunks,
                 num_microbatches=num_microbatches, layout=layout, split_backward=True)  # fmt: skip
    probe = ScheduleTable(**shape, ranks=((),) * pp_size)  # type: ignore[arg-type]
    pending = [
        {Action(k, c, i) for k in (F, B, W) for c in range(num_chunks)
         for i in range(num_microbatches)}
        for _ in range(pp_size)
    ]  # fmt: skip
    state = _Play(probe, dict(zip((F, B, W), costs, strict=True)), list(memory_limit), priority)
    while any(pending):
        state.round(pending)
        later = [t for t in (*state.free, *state.ends.values()) if t > state.now]
        if not later and any(pending):
            raise ValueError(
                f"{name}: memory_limit={list(memory_limit)} leaves no way to finish; allow more "
                "micro-batches in flight."
            )
        state.now = min(later, default=state.now)
    return ScheduleTable(**shape, ranks=tuple(map(tuple, state.out)))  # type: ignore[arg-type]


class _Play:
    """The list scheduler's clock, per-rank state and output."""

    def __init__(
        self, table: ScheduleTable, dur: dict[ActionKind, float], limit: list[int], key: Key
    ) -> None:
        self.table, self.dur, self.limit, self.key = table, dur, limit, key
        self.now = 0.0
        self.free = [0.0] * table.pp_size
        self.held = [0] * table.pp_size
        self.ends: dict[tuple[ActionKind, int, int], float] = {}
        self.out: list[list[Action]] = [[] for _ in range(table.pp_size)]

    def round(self, pending: list[set[Action]]) -> None:
        """Every rank free at ``now`` starts its most urgent ready action."""
        for rank in range(self.table.pp_size):
            if self.free[rank] > self.now:
                continue
            room = self.held[rank] < self.limit[rank]
            pick = _pick(self.table, rank, pending[rank], self.ends, self.now, room, self.key)
            if pick is None:
                continue
            action, stage = pick
            pending[rank].discard(action)
            self.out[rank].append(action)
            self.free[rank] = self.now + self.dur[action.kind]
            self.ends[(action.kind, stage, action.microbatch)] = self.free[rank]
            self.held[rank] += {F: 1, B: 0, W: -1}[action.kind]


def _pick(
    table: ScheduleTable,
    rank: int,
    pending: set[Action],
    ends: dict[tuple[ActionKind, int, int], float],
    now: float,
    room: bool,
    priority: Key,
) -> tuple[Action, int] | None:
    """The most urgent of ``rank``'s actions whose inputs exist at ``now`` (forwards only with
    ``room`` for more activations)."""
    best: tuple[tuple[float, ...], Action, int] | None = None
    for a in pending:
        if a.kind is F and not room:
            continue
        stage = table.stage_of(rank, a.chunk)
        deps = dependencies(a.kind, stage, a.microbatch, table.num_stages)
        if all(ends.get(d, now + 1) <= now for d in deps):
            key = priority(a, stage)
            if best is None or key < best[0]:
                best = (key, a, stage)
    return None if best is None else (best[1], best[2])


def zbh1_table(pp_size: int, num_microbatches: int) -> ScheduleTable:
    """ZB-H1: 1F1B's forwards and input-gradient backwards; rank ``r`` lags its ``W`` parts ``r``
    micro-batches behind its ``B`` parts and runs the last ``r`` of them at the end."""
    if pp_size < 1 or num_microbatches < 1:
        raise ValueError(
            f"pp_size={pp_size} and num_microbatches={num_microbatches} must both be >= 1."
        )
    m, ranks = num_microbatches, []
    for rank in range(pp_size):
        warmup = min(pp_size - rank - 1, m)
        out = [Action(F, 0, i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                out.append(Action(F, 0, warmup + i))
            out.append(Action(B, 0, i))
            if i - rank >= 0:
                out.append(Action(W, 0, i - rank))
        out += [Action(W, 0, i) for i in range(max(0, m - rank), m)]
        ranks.append(tuple(out))
    return ScheduleTable(name="zbh1", pp_size=pp_size, num_chunks=1, num_microbatches=m,
                         layout="loop", split_backward=True, ranks=tuple(ranks))  # fmt: skip


def zbv_table(
    pp_size: int, num_microbatches: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> ScheduleTable:
    """ZB-V: two chunks per rank in the ``v`` layout, at most ``2p`` chunk-micro-batches alive on
    every rank, scheduled for the relative ``(F, B, W)`` costs."""
    if len(costs) != 3 or any(not c > 0 for c in costs):
        raise ValueError(f"costs={costs!r} must be three positive (F, B, W) durations.")
    return list_schedule(name="zbv", pp_size=pp_size, num_chunks=2,
                         num_microbatches=num_microbatches, layout="v",
                         memory_limit=[2 * pp_size] * pp_size, costs=costs)  # fmt: skip


def zbh1_bubble(pp_size: int, num_microbatches: int, num_chunks: int = 1) -> float | None:
    """ZB-H1's bubble fraction with ``F = B = W = 1``: the deferred ``W`` parts fill two thirds
    of 1F1B's bubble, ``(p-1)/(3m+p-1)``; ``None`` for ``m < p`` (the bubble is larger)."""
    p, m = pp_size, num_microbatches
    return (p - 1) / (3 * m + p - 1) if m >= p else None


def zbv_bubble(pp_size: int, num_microbatches: int, num_chunks: int = 2) -> float | None:
    """ZB-V's bubble fraction with ``F = B = W = 1``: only the start-up wait of ``r`` units on
    rank ``r`` is left, ``(p-1)/(6m+p-1)``; ``None`` for ``m < p`` (the bubble is larger)."""
    p, m = pp_size, num_microbatches
    return (p - 1) / (6 * m + p - 1) if m >= p else None
