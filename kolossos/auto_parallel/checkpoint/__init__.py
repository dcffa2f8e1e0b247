"""Activation-checkpoint search (Colossal-Auto's ``colossalai.auto_parallel.checkpoint``).

Linearise a traced model into its blocks (:func:`linearize`), measure the chain of stages
(:func:`profile_chain`), find the cheapest recomputation plan under a
memory budget (:class:`CheckpointSolverRotor`), and apply it (:func:`apply_checkpoint_plan`).

Example:
    >>> blocks = list(model)  # an nn.Sequential of blocks
    >>> chain = profile_chain(blocks, sample_batch)
    >>> plan = CheckpointSolverRotor(chain, free_memory=budget_bytes).solve()
    >>> model = apply_checkpoint_plan(blocks, plan)
"""

from __future__ import annotations

from kolossos.auto_parallel.checkpoint.apply import CheckpointSegment, apply_checkpoint_plan
from kolossos.auto_parallel.checkpoint.chain import Chain, Stage, activation_bytes, profile_chain
from kolossos.auto_parallel.checkpoint.linearize import linearize
from kolossos.auto_parallel.checkpoint.plan import CheckpointPlan, Segment, plan_peak
from kolossos.auto_parallel.checkpoint.rotor import CheckpointSolverRotor, InfeasibleBudgetError

__all__ = [
    "Chain",
    "CheckpointPlan",
    "CheckpointSegment",
    "CheckpointSolverRotor",
    "InfeasibleBudgetError",
    "Segment",
    "Stage",
    "activation_bytes",
    "apply_checkpoint_plan",
    "linearize",
    "plan_peak",
    "profile_chain",
]
