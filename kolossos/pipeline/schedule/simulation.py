"""The schedule simulator's core: run a :class:`ScheduleTable` on modelled action costs.

Each rank executes its actions in table order, each as soon as its inputs exist (the previous
stage's forward, the next stage's backward; plus a fixed communication latency between ranks).
A table whose orders wait on each other in a cycle cannot finish: :func:`simulate` raises
:class:`DeadlockError` naming the stuck actions. The command line, the charts and the closed
forms are in :mod:`kolossos.pipeline.simulate` (which re-exports these names); this module sits
inside the schedule package so the runners can use it without importing the command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from kolossos.pipeline.schedule.table import ActionKind, ScheduleTable, dependencies

__all__ = ["Costs", "DeadlockError", "Timeline", "simulate"]


class DeadlockError(RuntimeError):
    """The ranks' action orders wait on each other in a cycle."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Modelled duration of each action, in arbitrary time units."""

    forward: float = 1.0
    """one micro-batch through one chunk"""
    backward: float = 2.0
    """full backward (input and weight gradients)"""
    input_grad: float = 1.0
    """split backward, input-gradient part"""
    weight_grad: float = 1.0
    """split backward, weight-gradient part"""
    comm: float = 0.0
    """latency of a message between two ranks"""

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "input_grad", "weight_grad", "comm"):
            if getattr(self, name) < 0:
                raise ValueError(f"Costs.{name}={getattr(self, name)} must be >= 0.")

    def of(self, kind: ActionKind, split: bool) -> float:
        """Duration of an action of ``kind`` (``split``: the table splits the backward)."""
        if kind is ActionKind.F:
            return self.forward
        if kind is ActionKind.W:
            return self.weight_grad
        return self.input_grad if split else self.backward


@dataclass(frozen=True)
class Timeline:
    """Start and end time of every action of every rank (``spans[r][k]`` for the ``k``-th action
    of rank ``r``)."""

    table: ScheduleTable
    spans: tuple[tuple[tuple[float, float], ...], ...]

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end."""
        return max((s[-1][1] for s in self.spans if s), default=0.0)

    def busy(self, rank: int) -> float:
        """Total compute time of ``rank``."""
        return sum(end - start for start, end in self.spans[rank])

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ``pp_size x makespan`` (0: every rank always busy)."""
        total = self.table.pp_size * self.makespan
        return 1.0 - sum(self.busy(r) for r in range(self.table.pp_size)) / total if total else 0.0


def simulate(table: ScheduleTable, costs: Costs | None = None) -> Timeline:
    """Execute ``table`` on modelled costs (each action as early as its rank and inputs allow).

    Raises:
        DeadlockError: some ranks can never proceed (cyclic waits between their orders).
    """
    costs = costs or Costs()
    n = table.num_stages
    done: dict[tuple[ActionKind, int, int], tuple[float, int]] = {}  # -> (end time, rank)
    spans: list[list[tuple[float, float]]] = [[] for _ in range(table.pp_size)]
    clock = [0.0] * table.pp_size
    pos = [0] * table.pp_size
    remaining = sum(len(a) for a in table.ranks)
    while remaining:
        progress = False
        for rank, actions in enumerate(table.ranks):
            while pos[rank] < len(actions):
                action = actions[pos[rank]]
                stage = table.stage_of(rank, action.chunk)
                deps = dependencies(action.kind, stage, action.microbatch, n)
                if any(d not in done for d in deps):
                    break
                start = clock[rank]
                for d in deps:
                    end, owner = done[d]
                    start = max(start, end + (costs.comm if owner != rank else 0.0))
                end = start + costs.of(action.kind, table.split_backward)
                done[(action.kind, stage, action.microbatch)] = (end, rank)
                spans[rank].append((start, end))
                clock[rank] = end
                pos[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = [
                f"rank {r} at {table.ranks[r][pos[r]]}"
                for r in range(table.pp_size)
                if pos[r] < len(table.ranks[r])
            ]
            raise DeadlockError(f"{table.name} deadlocks: {', '.join(stuck)} wait in a cycle.")
    return Timeline(table, tuple(tuple(s) for s in spans))
