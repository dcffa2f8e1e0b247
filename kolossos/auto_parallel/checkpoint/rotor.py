"""``CheckpointSolverRotor``: the cheapest recomputation plan of a chain under a memory budget.

After Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains", 2019): a dynamic
program over the chain's stages and the memory already held. ``best(i, m)`` is the least
recomputation time for stages ``i..n-1`` when earlier segments keep ``m`` memory units; each step
either keeps stage ``i`` whole (no cost) or checkpoints a segment ``i..j-1`` (cost: its forward
time), as long as ``m`` plus the segment's need (:func:`~.plan.segment_cost`) fits the budget. This
is the plan space ``torch.utils.checkpoint`` can apply (one level of checkpointing: a recomputed
segment stores all its activations during its own backward).

Memory is counted in units of ``budget / memory_slots`` bytes, each stage's figures rounded up (as
upstream does), so the plan found never exceeds the budget under the model; ``memory_slots=None``
counts single bytes (exact, for short chains and tests).
"""

from __future__ import annotations

import functools
import math
import sys

from kolossos.auto_parallel.checkpoint.chain import Chain
from kolossos.auto_parallel.checkpoint.plan import CheckpointPlan, Segment, plan_peak, segment_cost

__all__ = ["CheckpointSolverRotor", "InfeasibleBudgetError"]


class InfeasibleBudgetError(ValueError):
    """No plan of the chain fits the memory budget."""


class CheckpointSolverRotor:
    """Find which segments of a chain to recompute to fit ``free_memory`` bytes of activations.

    Unlike upstream, whose solver takes an annotated ``torch.fx`` graph, this one takes the
    :class:`~kolossos.auto_parallel.checkpoint.Chain` the graph or the model is linearised into
    (see :func:`~kolossos.auto_parallel.checkpoint.profile_chain`).

    Args:
        chain: the stages with their measured costs.
        free_memory: the activation memory budget in bytes.
        memory_slots: how many units the budget is cut into (``None``: one byte per unit).

    Raises:
        ValueError: a non-positive budget or slot count.

    Example:
        >>> chain = profile_chain(blocks, x)
        >>> plan = CheckpointSolverRotor(chain, free_memory=64 * 2**20).solve()
        >>> model = apply_checkpoint_plan(blocks, plan)
    """

    def __init__(self, chain: Chain, free_memory: int, memory_slots: int | None = 500) -> None:
        if free_memory <= 0:
            raise ValueError(f"free_memory={free_memory} must be a positive number of bytes.")
        if memory_slots is not None and memory_slots <= 0:
            raise ValueError(f"memory_slots={memory_slots} must be positive or None.")
        self.chain = chain
        self.free_memory = int(free_memory)
        self.memory_slots = memory_slots
        self.unit = 1 if memory_slots is None else max(1, math.ceil(free_memory / memory_slots))
        self.budget_units = self.free_memory // self.unit

    def _options(self, i: int) -> list[tuple[int, int, float, int, bool]]:
        """(need, kept, cost, next stage, checkpointed) of each segment that may start at ``i``."""
        need, kept, cost = segment_cost(self.chain, i, i + 1, False, self.unit)
        options = [(need, kept, cost, i + 1, False)]
        for end in range(i + 1, len(self.chain) + 1):
            need, kept, cost = segment_cost(self.chain, i, end, True, self.unit)
            options.append((need, kept, cost, end, True))
        return options

    def solve(self) -> CheckpointPlan:
        """Run the dynamic program and return the cheapest feasible plan.

        Raises:
            InfeasibleBudgetError: even the most frugal plan needs more than ``free_memory``.
        """
        n, budget = len(self.chain), self.budget_units
        options = [self._options(i) for i in range(n)]

        @functools.cache
        def best(i: int, held: int) -> tuple[float, tuple[tuple[int, bool], ...]] | None:
            if i == n:
                return 0.0, ()
            found: tuple[float, tuple[tuple[int, bool], ...]] | None = None
            for need, kept, cost, end, ckpt in options[i]:
                if held + need > budget:
                    continue
                rest = best(end, held + kept)
                if rest is not None and (found is None or cost + rest[0] < found[0]):
                    found = (cost + rest[0], ((end, ckpt), *rest[1]))
            return found

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * n + 100))
        try:
            answer = best(0, 0)
        finally:
            sys.setrecursionlimit(limit)
        if answer is None:
            raise InfeasibleBudgetError(
                f"no checkpoint plan of the {n}-stage chain fits free_memory={self.free_memory} "
                f"bytes; the most frugal plan needs {self.minimum_memory()} bytes. Raise the "
                "budget or split the model into more, smaller stages."
            )
        segments, start = [], 0
        for end, ckpt in answer[1]:
            segments.append(Segment(start=start, end=end, checkpointed=ckpt))
            start = end
        peak_units, recompute = plan_peak(self.chain, tuple(segments), self.unit)
        return CheckpointPlan(
            segments=tuple(segments),
            recompute_time=recompute,
            predicted_peak_bytes=peak_units * self.unit,
        )

    def minimum_memory(self) -> int:
        """Bytes the most frugal plan (under this solver's rounding) needs."""
        n = len(self.chain)

        @functools.cache
        def least(i: int, held: int) -> int:
            if i == n:
                return 0
            return min(
                max(held + need, least(end, held + kept))
                for need, kept, _, end, _ in self._options(i)
            )

        return least(0, 0) * self.unit
