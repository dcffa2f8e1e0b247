"""Activation checkpointing inside ``autoparallelize`` for transformers: a Rotor plan over the
model's repeated blocks (GPT-2's ``transformer.h.*``) combined with a sharding plan family.

For a family's plan (:mod:`~kolossos.auto_parallel.transformer_plan`) the per-rank costs of each
block come from its operators' chosen strategies: a block's *saved* bytes are the activation bytes
its operators hold (``act_mem``), its *output* the bytes of its last operator in that operator's
layout, its *forward time* a third of its operators' forward + backward compute plus the forward
all-reduces of row- and vocabulary-parallel operators (recomputation runs them again). These form
a :class:`~kolossos.auto_parallel.checkpoint.Chain` that
:class:`~kolossos.auto_parallel.checkpoint.CheckpointSolverRotor` solves (exact bytes) for the
memory the budget leaves after everything outside the blocks (parameters, gradients, Adam states,
the embedding, head and loss activations). The predicted peak is that fixed part plus the Rotor
plan's peak; it is conservative: the head and loss activations are counted as alive while the
blocks' backward recomputes, when in a real step they are already freed.

:func:`search_with_checkpoint` takes the fastest family that fits as it is; only when none does,
each family gets the least-recompute plan that fits and the fastest (sharding plus
recomputation) is taken; :func:`apply_block_checkpoint` wraps the
chosen blocks' ``forward`` in ``torch.utils.checkpoint`` (non-reentrant).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from kolossos.auto_parallel.checkpoint import Chain, CheckpointPlan, CheckpointSolverRotor, Stage
from kolossos.auto_parallel.checkpoint import InfeasibleBudgetError as _RotorInfeasible
from kolossos.auto_parallel.module_graph import OperatorGroup
from kolossos.auto_parallel.sharding_graph import DagPlan
from kolossos.auto_parallel.solver import InfeasibleBudgetError
from kolossos.auto_parallel.strategies import CostModel
from kolossos.auto_parallel.transformer_plan import family_plans

__all__ = [
    "BlockCheckpoint",
    "apply_block_checkpoint",
    "block_chain",
    "checkpoint_family",
    "repeated_blocks",
    "search_with_checkpoint",
    "smallest_peak",
]

_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True, kw_only=True)
class BlockCheckpoint:
    """A Rotor plan over a family's repeated blocks, with the predicted totals."""

    blocks: tuple[str, ...]
    """Module paths of the blocks, in order (the chain's stages)."""
    plan: CheckpointPlan
    """Which blocks are recomputed (stage ``i`` is ``blocks[i]``)."""
    fixed_bytes: float
    """Per-rank bytes outside the blocks (parameters, gradients, Adam states, other activations)."""
    memory: float
    """Predicted per-rank peak bytes of a step with the plan."""
    step_time: float
    """Predicted seconds of a step: the family's plus the recomputation."""

    @property
    def recomputed(self) -> list[str]:
        """Module paths of the blocks recomputed in the backward."""
        return [self.blocks[i] for i in self.plan.checkpointed_stages]

    def describe(self) -> str:
        """Which blocks are recomputed and the predicted memory and time."""
        return (
            f"activation checkpointing (Rotor) over {len(self.blocks)} blocks: "
            f"{self.plan.describe()}; recomputed {', '.join(self.recomputed) or 'none'}; "
            f"predicted recompute {self.plan.recompute_time * 1e3:.3f} ms, step "
            f"{self.step_time * 1e3:.3f} ms, peak memory per rank {self.memory / 2**20:.3f} MB"
        )


def repeated_blocks(groups: Sequence[OperatorGroup]) -> tuple[list[str], list[list[int]]]:
    """The repeated blocks (``<prefix>.<index>``, the prefix with most indices) and the
    positions of each block's operators in ``groups``; empty when the model has none."""
    found: dict[str, dict[int, list[int]]] = {}
    for position, group in enumerate(groups):
        match = _BLOCK.match(group.path)
        if match:
            found.setdefault(match[1], {}).setdefault(int(match[2]), []).append(position)
    if not found:
        return [], []
    prefix = max(found, key=lambda p: len(found[p]))
    if len(found[prefix]) < 2:
        return [], []
    indices = sorted(found[prefix])
    return [f"{prefix}.{i}" for i in indices], [found[prefix][i] for i in indices]


def _forward_time(strategy: Any) -> float:
    # Recomputation runs the forward: a third of forward + backward compute, and the forward
    # all-reduce of a row- or vocabulary-parallel operator.
    forward_comm = strategy.comm_s if strategy.name in ("row", "vocab") else 0.0
    return float(strategy.compute_s / 3 + forward_comm)


def block_chain(
    groups: Sequence[OperatorGroup], plan: DagPlan, world_size: int
) -> tuple[list[str], Chain, float]:
    """``(block paths, chain, activation bytes the blocks hold)`` of ``plan`` over ``groups``.

    Raises:
        InfeasibleBudgetError: the model has no repeated blocks to checkpoint.
    """
    names, members = repeated_blocks(groups)
    if not names:
        raise InfeasibleBudgetError(
            "activation checkpointing needs repeated blocks (module paths such as "
            "'transformer.h.0', 'transformer.h.1'); the model has none."
        )
    stages, held = [], 0.0
    for name, positions in zip(names, members, strict=True):
        chosen = [plan.strategies[i] for i in positions]
        saved = sum(s.act_mem for s in chosen)
        last, out_strategy = groups[positions[-1]], chosen[-1]
        div = world_size if out_strategy.out_layout in ("B", "F") else 1
        output = last.out_bytes / div
        largest = max(groups[i].out_bytes for i in positions) / div
        stages.append(
            Stage(
                name=name,
                forward_time=sum(_forward_time(s) for s in chosen),
                saved_bytes=int(saved),
                output_bytes=int(output),
                forward_peak_bytes=int(saved + largest),
                backward_peak_bytes=int(2 * largest),
            )
        )
        held += saved
    return names, Chain(stages=tuple(stages)), held


def _forward_memory(plan: DagPlan) -> tuple[float, float]:
    """``(end-of-forward bytes, end-of-backward floor)`` of a plan (its memory is the max)."""
    forward = sum(s.memory for s in plan.strategies)
    return forward, plan.memory if plan.memory > forward else 0.0


def checkpoint_family(
    groups: Sequence[OperatorGroup], plan: DagPlan, world_size: int, budget: float
) -> BlockCheckpoint:
    """The least-recompute checkpoint plan of ``plan``'s blocks that fits ``budget`` bytes.

    Raises:
        InfeasibleBudgetError: no plan fits; the message gives the smallest reachable peak.
    """
    names, chain, held = block_chain(groups, plan, world_size)
    forward, floor = _forward_memory(plan)
    fixed = forward - held
    smallest = smallest_peak(groups, plan, world_size)
    free = int(budget - fixed)
    if budget < floor or free <= 0:
        raise InfeasibleBudgetError(f"smallest reachable peak {smallest:.0f} bytes per rank")
    try:
        rotor = CheckpointSolverRotor(chain, free_memory=free, memory_slots=None).solve()
    except _RotorInfeasible as exc:
        raise InfeasibleBudgetError(
            f"smallest reachable peak {smallest:.0f} bytes per rank"
        ) from exc
    return BlockCheckpoint(
        blocks=tuple(names),
        plan=rotor,
        fixed_bytes=fixed,
        memory=max(fixed + rotor.predicted_peak_bytes, floor),
        step_time=plan.step_time + rotor.recompute_time,
    )


def smallest_peak(groups: Sequence[OperatorGroup], plan: DagPlan, world_size: int) -> float:
    """The lowest per-rank peak ``plan`` reaches with any checkpointing of its blocks.

    Raises:
        InfeasibleBudgetError: the model has no repeated blocks.
    """
    _, chain, held = block_chain(groups, plan, world_size)
    forward, floor = _forward_memory(plan)
    return max(forward - held + _least_peak(chain), floor)


@functools.lru_cache(maxsize=64)
def _least_peak(chain: Chain) -> int:
    return CheckpointSolverRotor(chain, free_memory=1, memory_slots=None).minimum_memory()


def search_with_checkpoint(
    groups: Sequence[OperatorGroup],
    cost: CostModel,
    memory_budget: float | None = None,
    hybrid: Mapping[int, Sequence[OperatorGroup]] | None = None,
) -> tuple[str, DagPlan, Sequence[OperatorGroup], BlockCheckpoint | None]:
    """``(family, plan, its operators, checkpoint plan or None)``: the fastest family that fits
    the budget as it is (as :func:`~kolossos.auto_parallel.transformer_plan.
    search_transformer_plan`); when none fits, the fastest family combined with the
    least-recompute Rotor plan of its blocks that fits.

    Raises:
        InfeasibleBudgetError: nothing fits even with checkpointing; the message names the
            budget and the smallest peak any family reaches.
    """
    budget = float("inf") if memory_budget is None else float(memory_budget)
    plans = family_plans(groups, cost, hybrid)
    fitting = {f: p for f, (p, _) in plans.items() if p.memory <= budget}
    if fitting:  # no recomputation while some family fits as it is
        family = min(fitting, key=lambda f: (fitting[f].step_time, fitting[f].memory))
        return family, fitting[family], plans[family][1], None
    options: dict[str, BlockCheckpoint] = {}
    smallest: dict[str, str] = {}
    for family, (plan, ops) in plans.items():
        try:
            options[family] = checkpoint_family(ops, plan, cost.world_size, budget)
        except InfeasibleBudgetError as exc:
            smallest[family] = str(exc)
    if not options:
        details = "; ".join(f"{f}: {why}" for f, why in smallest.items())
        raise InfeasibleBudgetError(
            f"no plan fits the memory budget of {budget:.0f} bytes per rank on "
            f"{cost.world_size} ranks, even with activation checkpointing of the model's "
            f"blocks ({details}). Raise memory_budget to at least the smallest reachable "
            "peak, or use more ranks."
        )
    family = min(options, key=lambda f: options[f].step_time)
    plan, ops = plans[family]
    return family, plan, ops, options[family]


def apply_block_checkpoint(module: nn.Module, paths: Sequence[str]) -> None:
    """Run each block at ``paths`` (module paths in ``module``) under ``torch.utils.checkpoint``
    (non-reentrant): its activations are dropped in the forward and recomputed in the backward.

    Raises:
        AttributeError: a path that names no submodule.
    """
    for path in paths:
        block = module.get_submodule(path)
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
