"""Apply a :class:`~kolossos.auto_parallel.checkpoint.CheckpointPlan` to the chain's modules."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from kolossos.auto_parallel.checkpoint.plan import CheckpointPlan

__all__ = ["CheckpointSegment", "apply_checkpoint_plan"]


class CheckpointSegment(torch.nn.Module):
    """Run ``stages`` under ``torch.utils.checkpoint`` (non-reentrant): keep only the input, and
    recompute the stages' activations in the backward."""

    def __init__(self, stages: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.stages = torch.nn.Sequential(*stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.stages, x, use_reentrant=False)
        return out


def apply_checkpoint_plan(
    stages: Sequence[torch.nn.Module], plan: CheckpointPlan
) -> torch.nn.Sequential:
    """Return a ``Sequential`` running ``stages`` with the plan's segments checkpointed.

    The stage modules are shared, not copied: the result trains the same parameters.

    Raises:
        ValueError: the plan does not cover exactly ``len(stages)`` stages.
    """
    covered = plan.segments[-1].end if plan.segments else 0
    if covered != len(stages):
        raise ValueError(f"the plan covers {covered} stages; {len(stages)} were given.")
    parts: list[torch.nn.Module] = []
    for seg in plan.segments:
        chunk = list(stages[seg.start : seg.end])
        if seg.checkpointed:
            parts.append(CheckpointSegment(chunk))
        else:
            parts.extend(chunk)
    return torch.nn.Sequential(*parts)
