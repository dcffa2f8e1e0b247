"""Checkpoint plans and the memory model that prices them.

A plan cuts a chain into consecutive segments; a checkpointed segment keeps only its output during
the forward and recomputes its stages in the backward, a plain segment keeps every activation. The
model below gives, for a segment entered with ``prefix`` bytes already kept by earlier segments,
the extra bytes it needs at its worst moment (forward or backward) and the bytes it keeps; the
peak of a plan is the largest ``prefix + need`` over its segments. It is conservative: the output
of a segment and the gradient arriving at it are counted as alive through the segment's backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kolossos.auto_parallel.checkpoint.chain import Chain

__all__ = ["CheckpointPlan", "Segment", "plan_peak", "segment_cost"]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Stages ``start`` (inclusive) to ``end`` (exclusive) of a chain."""

    start: int
    """First stage index."""
    end: int
    """One past the last stage index."""
    checkpointed: bool
    """Whether the segment's activations are dropped in the forward and recomputed."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"Segment [{self.start}, {self.end}) must satisfy 0 <= start < end.")


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """The solver's answer: segments covering the chain, with their predicted costs."""

    segments: tuple[Segment, ...]
    """Consecutive segments from stage 0 to the last stage."""
    recompute_time: float
    """Predicted seconds of recomputation per step (the sum of the checkpointed stages' times)."""
    predicted_peak_bytes: int
    """Predicted peak activation bytes of a training step under the plan."""

    @property
    def checkpointed_stages(self) -> list[int]:
        """Indices of the stages that are recomputed."""
        return [i for s in self.segments if s.checkpointed for i in range(s.start, s.end)]

    def describe(self) -> str:
        """One line, e.g. ``[0] ckpt[1..3] [4]``."""
        parts = []
        for s in self.segments:
            stages = f"{s.start}" if s.end - s.start == 1 else f"{s.start}..{s.end - 1}"
            parts.append(f"ckpt[{stages}]" if s.checkpointed else f"[{stages}]")
        return " ".join(parts)


def _units(nbytes: int, unit: int) -> int:
    return math.ceil(nbytes / unit)


def segment_cost(
    chain: Chain, start: int, end: int, checkpointed: bool, unit: int = 1
) -> tuple[int, int, float]:
    """Return ``(need, kept, recompute_time)`` of one segment, memory in ``unit``-byte units.

    ``need`` is the most memory the segment needs above what earlier segments keep; ``kept`` is
    what it keeps from its forward until its backward. Each stage's figures are rounded up to
    whole units, so a plan feasible in units is feasible in bytes.
    """
    stages = chain.stages[start:end]
    saved = [_units(s.saved_bytes, unit) for s in stages]
    fpeak = [_units(s.forward_peak_bytes, unit) for s in stages]
    bextra = [_units(s.backward_peak_bytes, unit) for s in stages]
    if not checkpointed:
        # a plain segment is a run of single stages, each backward done before the previous one's
        need, prefix = 0, 0
        for i in range(len(stages)):
            need = max(need, prefix + fpeak[i])
            prefix += saved[i]
        for i in reversed(range(len(stages))):
            prefix_before = sum(saved[:i])
            need = max(need, prefix_before + saved[i] + bextra[i])
        return need, sum(saved), 0.0
    out = _units(stages[-1].output_bytes, unit)
    # forward without grad: one stage at a time, nothing kept but the segment's output
    need = max(fpeak)
    # backward: recompute with grad (output and its grad alive), then backward stage by stage
    for j in range(len(stages)):
        need = max(need, 2 * out + sum(saved[:j]) + fpeak[j])
        need = max(need, out + sum(saved[: j + 1]) + bextra[j])
    recompute = sum(s.forward_time for s in stages)
    return need, out, recompute


def plan_peak(chain: Chain, segments: tuple[Segment, ...], unit: int = 1) -> tuple[int, float]:
    """Return ``(predicted peak in units, recompute time)`` of a segmentation of ``chain``.

    Raises:
        ValueError: the segments do not cover the chain consecutively.
    """
    position, prefix, peak, recompute = 0, 0, 0, 0.0
    for seg in segments:
        if seg.start != position:
            raise ValueError(f"segment {seg} does not start at stage {position}.")
        need, kept, seconds = segment_cost(chain, seg.start, seg.end, seg.checkpointed, unit)
        peak = max(peak, prefix + need)
        prefix += kept
        recompute += seconds
        position = seg.end
    if position != len(chain):
        raise ValueError(f"segments end at stage {position}; the chain has {len(chain)} stages.")
    return peak, recompute
