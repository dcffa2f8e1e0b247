"""The sharding-strategy solver: a dynamic program over a chain of operators.

Nodes are visited in order; the state is the layout of the tensor between two nodes. For each
state the program keeps the Pareto front of (predicted step time, per-rank memory) partial plans,
so the memory budget is met exactly (no discretisation): the answer is the fastest full plan whose
memory fits. A layout change between neighbours costs :func:`reshard_cost` (all-gather for
``B``/``F`` <-> ``R``, all-to-all for ``B`` <-> ``F``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kolossos.auto_parallel.strategies import CostModel, Layout, Strategy, reshard_cost

__all__ = [
    "DATA_PARALLEL",
    "TENSOR_PARALLEL",
    "ChainNode",
    "InfeasibleBudgetError",
    "Plan",
    "solve_chain",
]

DATA_PARALLEL: tuple[Layout, ...] = ("B",)
"""Layouts of a pure data-parallel plan."""
TENSOR_PARALLEL: tuple[Layout, ...] = ("R", "F")
"""Layouts of a pure tensor-parallel (Megatron column/row) plan."""


class InfeasibleBudgetError(ValueError):
    """No plan fits the per-rank memory budget."""


@dataclass(frozen=True, kw_only=True)
class ChainNode:
    """One operator of the chain: its name, input and output bytes (full size), strategies."""

    name: str
    in_bytes: float
    strategies: Sequence[Strategy]
    out_bytes: float = 0.0
    """Full output bytes; used to charge the last node's conversion to a loss layout."""


@dataclass(frozen=True, kw_only=True)
class StrategyPlan:
    """One strategy per node (in node order) plus the predicted totals."""

    nodes: tuple[str, ...]
    strategies: tuple[Strategy, ...]
    reshard_s: tuple[float, ...]
    """Time of the layout conversions in front of each node (on its inputs)."""
    step_time: float
    memory: float

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(zip(self.nodes, self.strategies, strict=True))

    @property
    def names(self) -> tuple[str, ...]:
        """The strategy names in node order (e.g. ``("col", "R", "row")``)."""
        return tuple(s.name for s in self.strategies)

    def strategy(self, node: str) -> Strategy:
        """The strategy chosen for ``node``."""
        return self.strategies[self.nodes.index(node)]


@dataclass(frozen=True, kw_only=True)
class Plan(StrategyPlan):
    """The chain solver's answer: a :class:`StrategyPlan` and the layout of the chain's input."""

    input_layout: Layout


# A partial plan: (time, memory, chosen strategy indices, reshard times, input layout).
_Partial = tuple[float, float, tuple[int, ...], tuple[float, ...], str]


def _pareto(items: list[_Partial]) -> list[_Partial]:
    items.sort(key=lambda t: (t[0], t[1]))
    front: list[_Partial] = []
    for item in items:
        if not front or item[1] < front[-1][1]:
            front.append(item)
    return front


def solve_chain(
    chain: Sequence[ChainNode],
    cost: CostModel,
    *,
    memory_budget: float | None = None,
    input_layouts: Collection[Layout] = ("B", "R"),
    output_layouts: Collection[Layout] = ("B", "R"),
    allowed_layouts: Collection[Layout] = ("B", "R", "F"),
) -> Plan:
    """The fastest plan of ``chain`` whose per-rank memory is at most ``memory_budget``.

    Args:
        chain: the operators in execution order.
        cost: the cost model (used for the layout conversions).
        memory_budget: bytes per rank; ``None`` for no limit.
        input_layouts: layouts the data loader can give the first node (free).
        output_layouts: layouts the loss accepts at the end.
        allowed_layouts: restrict every tensor to these layouts (e.g. ``("B",)`` for pure
            data parallelism, ``("R", "F")`` for pure tensor parallelism).

    Raises:
        InfeasibleBudgetError: no plan fits the budget (the message gives the smallest one).
    """
    if not chain:
        raise ValueError("solve_chain needs at least one node.")
    budget = float("inf") if memory_budget is None else float(memory_budget)
    fronts: dict[Layout, list[_Partial]] = {
        layout: [(0.0, 0.0, (), (), layout)]
        for layout in input_layouts
        if layout in allowed_layouts
    }
    for node in chain:
        new: dict[Layout, list[_Partial]] = {}
        for index, strat in enumerate(node.strategies):
            if strat.out_layout not in allowed_layouts or strat.in_layout not in allowed_layouts:
                continue
            for layout, front in fronts.items():
                move = reshard_cost(layout, strat.in_layout, node.in_bytes, cost)
                for time, mem, picks, moves, start in front:
                    total_mem = mem + strat.memory
                    if total_mem <= budget:
                        new.setdefault(strat.out_layout, []).append(
                            (
                                time + move + strat.time,
                                total_mem,
                                (*picks, index),
                                (*moves, move),
                                start,
                            )
                        )
        fronts = {layout: _pareto(items) for layout, items in new.items()}
    # The last tensor may be converted (e.g. gathered F -> R) for the loss.
    last_bytes = chain[-1].out_bytes
    finals = []
    for layout, front in fronts.items():
        for target in output_layouts:
            move = reshard_cost(layout, target, last_bytes, cost)
            extra = (
                0.0 if target == layout or target != "R" else last_bytes * (1 - 1 / cost.world_size)
            )
            for time, mem, picks, moves, start in front:
                if mem + extra <= budget:
                    finals.append((target, (time + move, mem + extra, picks, moves, start)))
    if not finals:
        raise InfeasibleBudgetError(
            f"no sharding plan fits the memory budget of {budget:.0f} bytes per rank on "
            f"{cost.world_size} ranks with layouts {sorted(allowed_layouts)}; "
            f"plans need at least {_smallest(chain, allowed_layouts):.0f} bytes. Raise "
            "memory_budget or use more ranks."
        )
    _, (time, mem, picks, moves, start) = min(finals, key=lambda f: (f[1][0], f[1][1]))
    return Plan(
        nodes=tuple(n.name for n in chain),
        strategies=tuple(n.strategies[i] for n, i in zip(chain, picks, strict=True)),
        input_layout=start,  # type: ignore[arg-type]
        reshard_s=moves,
        step_time=time,
        memory=mem,
    )


def _smallest(chain: Sequence[ChainNode], allowed: Collection[Layout]) -> float:
    """A lower bound on any plan's memory: each node's smallest allowed strategy."""
    return sum(
        min(
            (s.memory for s in n.strategies if {s.in_layout, s.out_layout} <= set(allowed)),
            default=float("inf"),
        )
        for n in chain
    )
