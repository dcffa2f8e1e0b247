"""Schedule tables: the ordered list of compute actions of every pipeline rank.

A table is data produced by a pure function (one per schedule) and consumed by one executor
(:mod:`kolossos.pipeline.schedule.executor`) and by the simulator
(:mod:`kolossos.pipeline.simulate`). Communication is implied by the actions: the forward of a
stage that is not the first receives its input from the previous stage, and the backward of a
stage that is not the last receives its output gradient from the next one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum

from kolossos.pipeline import layout as _layout


class ActionKind(str, Enum):
    """What an action computes."""

    F = "F"
    """forward of one micro-batch through one chunk"""
    B = "B"
    """backward: the full backward, or only the input gradient when the table splits it"""
    W = "W"
    """the weight gradient (split tables only), from the state the ``B`` of the same micro-batch
    left behind"""


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` on micro-batch ``microbatch`` of the local ``chunk``."""

    kind: ActionKind
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Message:
    """A tensor message implied by a table: an activation for ``stage``'s forward (``"act"``) or
    an output gradient for ``stage``'s backward (``"grad"``), of ``microbatch``."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True, kw_only=True)
class ScheduleTable:
    """The actions of every rank of one pipeline for one training step."""

    name: str
    """schedule name (``1f1b``, ``interleaved``, ...)"""
    pp_size: int
    """pipeline ranks"""
    num_chunks: int
    """model chunks (virtual stages) per rank"""
    num_microbatches: int
    layout: str
    """stage placement (:mod:`kolossos.pipeline.layout`)"""
    split_backward: bool
    """``B`` computes only input gradients and ``W`` the weight gradients"""
    ranks: tuple[tuple[Action, ...], ...]
    """``ranks[r]``: rank ``r``'s actions in execution order"""

    def __post_init__(self) -> None:
        _layout.check_layout(self.pp_size, self.num_chunks, self.layout)
        if len(self.ranks) != self.pp_size:
            raise ValueError(f"{len(self.ranks)} action lists for pp_size={self.pp_size}.")

    @property
    def num_stages(self) -> int:
        """Virtual stages in the whole pipeline."""
        return self.pp_size * self.num_chunks

    def stage_of(self, rank: int, chunk: int) -> int:
        """Global stage index of ``chunk`` on ``rank``."""
        return _layout.stage_of(rank, chunk, self.pp_size, self.num_chunks, self.layout)

    def owner_of(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` of a global stage."""
        return _layout.owner_of(stage, self.pp_size, self.num_chunks, self.layout)

    def sends(self, rank: int, action: Action) -> Message | None:
        """The message ``action`` on ``rank`` produces for another stage, if any."""
        stage = self.stage_of(rank, action.chunk)
        if action.kind is ActionKind.F and stage < self.num_stages - 1:
            return Message("act", stage + 1, action.microbatch)
        if action.kind is ActionKind.B and stage > 0:
            return Message("grad", stage - 1, action.microbatch)
        return None

    def needs(self, rank: int, action: Action) -> Message | None:
        """The message ``action`` on ``rank`` consumes, if any."""
        stage = self.stage_of(rank, action.chunk)
        if action.kind is ActionKind.F and stage > 0:
            return Message("act", stage, action.microbatch)
        if action.kind is ActionKind.B and stage < self.num_stages - 1:
            return Message("grad", stage, action.microbatch)
        return None

    def messages(self, src: int, dst: int) -> list[Message]:
        """Messages from rank ``src`` to rank ``dst`` in the order ``src`` sends them (the order
        ``dst`` must receive them in: point-to-point messages between two ranks match in order)."""
        out = []
        for action in self.ranks[src]:
            msg = self.sends(src, action)
            if msg is not None and self.owner_of(msg.stage)[0] == dst and dst != src:
                out.append(msg)
        return out

    def format(self) -> str:
        """One line per rank, e.g. ``rank 0: F0 F1 B0 F2 B1 B2``."""
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks)
        )


def validate_table(table: ScheduleTable) -> None:
    """Static checks of a table: every (stage, micro-batch) has exactly one ``F`` and one ``B``
    (and one ``W`` when split, none otherwise), on the rank owning the stage, and each rank runs
    ``F`` before ``B`` before ``W`` of the same micro-batch and chunk. Whether the ranks' orders
    together can run without deadlock is checked by :func:`kolossos.pipeline.simulate.simulate`.

    Raises:
        ValueError: the first violated rule.
    """
    kinds = [ActionKind.F, ActionKind.B] + ([ActionKind.W] if table.split_backward else [])
    for rank, actions in enumerate(table.ranks):
        counts = Counter(actions)
        expected = {
            Action(k, c, i)
            for k in kinds
            for c in range(table.num_chunks)
            for i in range(table.num_microbatches)
        }
        extra = set(counts) - expected
        missing = expected - set(counts)
        repeated = [a for a, n in counts.items() if n > 1]
        if extra or missing or repeated:
            raise ValueError(
                f"{table.name}: rank {rank} has unexpected {sorted(map(str, extra))}, missing "
                f"{sorted(map(str, missing))}, repeated {sorted(map(str, repeated))}."
            )
        position = {a: i for i, a in enumerate(actions)}
        for c in range(table.num_chunks):
            for i in range(table.num_microbatches):
                order = [position[Action(k, c, i)] for k in kinds]
                if order != sorted(order):
                    raise ValueError(
                        f"{table.name}: rank {rank} runs micro-batch {i} of chunk {c} out of "
                        f"order ({'/'.join(k.value for k in kinds)} at positions {order})."
                    )


def dependencies(
    kind: ActionKind, stage: int, microbatch: int, num_stages: int
) -> list[tuple[ActionKind, int, int]]:
    """The ``(kind, stage, micro-batch)`` actions that must finish before this one starts."""
    if kind is ActionKind.F:
        return [(ActionKind.F, stage - 1, microbatch)] if stage > 0 else []
    if kind is ActionKind.B:
        deps = [(ActionKind.F, stage, microbatch)]
        if stage < num_stages - 1:
            deps.append((ActionKind.B, stage + 1, microbatch))
        return deps
    return [(ActionKind.B, stage, microbatch)]
