"""The sharding solver over a whole graph: an integer linear program solved by SciPy's HiGHS.

Variables:

* ``x[n, s]`` (binary): node ``n`` runs strategy ``s``; ``sum_s x[n, s] = 1``.
* ``y[e, a, b]`` (continuous in [0, 1]): edge ``e`` goes from layout ``a`` (the producer's output)
  to layout ``b`` (what the consumer needs on that input). Its row sums equal the producer's
  indicator of ``a`` (``sum_b y[e, a, b] = sum_{s: out(s)=a} x[u, s]``) and its column sums the
  consumer's indicator of ``b``; with binary ``x`` exactly one ``y[e, a, b]`` is 1, so the
  product of the two choices is linear (one variable per *layout* pair, not per strategy pair).

A node sharing a weight with an earlier one (``tied_to``) may only pick a strategy its
``tie_allowed`` pairs with the owner's: ``x[owner, s] <= sum_{t allowed} x[node, t]``.

Objective: ``sum x·(compute + communication) + sum y·reshard time``. Memory:
``sum x·(parameters, optimizer states, activation) + sum y·(gathered copy into a sink) <=
budget`` and, for strategies that give one, ``sum x·end_mem <= budget`` (the end of
backward). SciPy is an optional dependency (``pip install 'kolossos[auto]'``), imported only
when solving; :func:`solve_graph` falls back to the chain dynamic program without it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection

import numpy as np

from kolossos.auto_parallel.sharding_graph import (
    DagNode,
    DagPlan,
    ShardingGraph,
    edge_cost,
    evaluate,
)
from kolossos.auto_parallel.solver import ChainNode, InfeasibleBudgetError, solve_chain
from kolossos.auto_parallel.strategies import CostModel, Layout

__all__ = ["have_ilp_solver", "restrict", "solve_graph", "solve_ilp"]

_INSTALL = "pip install 'kolossos[auto]'"


def have_ilp_solver() -> bool:
    """Whether SciPy (``scipy.optimize.milp``) is importable."""
    return importlib.util.find_spec("scipy") is not None


def restrict(graph: ShardingGraph, allowed: Collection[Layout]) -> ShardingGraph:
    """``graph`` keeping only the strategies whose every layout is in ``allowed``.

    Raises:
        InfeasibleBudgetError: a node has no strategy left (the message names it).
    """
    allowed = set(allowed)
    nodes = []
    for node in graph.nodes:
        kept = [
            s
            for s in node.strategies
            if s.out_layout in allowed
            and all(s.input_layout(k) in allowed for k in range(max(1, len(node.inputs))))
        ]
        if not kept:
            raise InfeasibleBudgetError(
                f"node {node.name!r} ({node.label or 'operator'}) has no strategy with layouts "
                f"in {sorted(allowed)}."
            )
        nodes.append(DagNode(**{**node.__dict__, "strategies": kept}))
    return ShardingGraph(tuple(nodes))


def _smallest_memory(graph: ShardingGraph) -> float:
    return sum(min(s.memory for s in node.strategies) for node in graph.nodes)


def solve_ilp(
    graph: ShardingGraph,
    cost: CostModel,
    *,
    memory_budget: float | None = None,
    time_limit_s: float = 60.0,
) -> DagPlan:
    """The fastest assignment of one strategy per node of ``graph`` within ``memory_budget``.

    Raises:
        ImportError: SciPy is not installed (the message says ``pip install 'kolossos[auto]'``).
        InfeasibleBudgetError: no assignment fits the budget.
        RuntimeError: HiGHS stopped without an optimal solution (e.g. the time limit).
    """
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as exc:  # pragma: no cover - scipy is installed in the test environment
        raise ImportError(
            f"the auto-parallel ILP solver needs SciPy; install it with {_INSTALL}."
        ) from exc
    nodes = graph.nodes
    offsets = np.cumsum([0] + [len(n.strategies) for n in nodes])
    time_c: list[float] = [s.time for n in nodes for s in n.strategies]
    mem_c: list[float] = [s.memory for n in nodes for s in n.strategies]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def constraint(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        row = len(lower)
        for col, val in entries:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    for i in range(len(nodes)):
        constraint([(c, 1.0) for c in range(offsets[i], offsets[i + 1])], 1.0, 1.0)
    for i, j, k in graph.edges():
        src = {s.out_layout for s in nodes[i].strategies}
        dst = {s.input_layout(k) for s in nodes[j].strategies}
        pairs = {}
        for a in sorted(src):
            for b in sorted(dst):
                pairs[a, b] = len(time_c)
                t, m = edge_cost(
                    a,
                    b,
                    nodes[i].out_bytes,
                    cost,
                    into_sink=nodes[j].sink,
                    no_batch=nodes[i].no_batch,
                )
                time_c.append(t)
                mem_c.append(m)
        for a in src:  # sum_b y[a, b] = [producer outputs a]
            producer = [
                (int(offsets[i]) + s, -1.0)
                for s, st in enumerate(nodes[i].strategies)
                if st.out_layout == a
            ]
            constraint([(pairs[a, b], 1.0) for b in dst] + producer, 0.0, 0.0)
        for b in dst:  # sum_a y[a, b] = [consumer needs b on input k]
            consumer = [
                (int(offsets[j]) + s, -1.0)
                for s, st in enumerate(nodes[j].strategies)
                if st.input_layout(k) == b
            ]
            constraint([(pairs[a, b], 1.0) for a in src] + consumer, 0.0, 0.0)
    index = {n.name: i for i, n in enumerate(nodes)}
    for j, node in enumerate(nodes):  # a tied weight: x[owner, s] <= sum of allowed x[node, t]
        if not node.tied_to:
            continue
        i = index[node.tied_to]
        for s, owner in enumerate(nodes[i].strategies):
            allowed = node.tie_allowed.get(owner.name, ())
            entries = [(int(offsets[i]) + s, 1.0)] + [
                (int(offsets[j]) + t, -1.0)
                for t, mine in enumerate(node.strategies)
                if mine.name in allowed
            ]
            constraint(entries, -np.inf, 0.0)
    num_x, num_vars = int(offsets[-1]), len(time_c)
    budget = float("inf") if memory_budget is None else float(memory_budget)
    if memory_budget is not None:
        constraint(list(enumerate(mem_c)), -np.inf, budget)
        end_c = [s.end_mem for n in nodes for s in n.strategies]
        if any(end_c):  # the end-of-backward moment must fit too
            constraint(list(enumerate(end_c)), -np.inf, budget)
    matrix = coo_array((vals, (rows, cols)), shape=(len(lower), num_vars)).tocsr()
    integrality = np.zeros(num_vars)
    integrality[:num_x] = 1
    # A tiny memory term breaks time ties towards the leaner plan (as the chain DP does).
    scale = max(max(time_c, default=0.0), 1e-30) / max(max(mem_c, default=0.0), 1.0) * 1e-9
    result = milp(
        c=np.asarray(time_c) + scale * np.asarray(mem_c),
        constraints=LinearConstraint(matrix, np.asarray(lower), np.asarray(upper)),
        integrality=integrality,
        bounds=Bounds(0.0, 1.0),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
    )
    if result.status == 2:
        raise InfeasibleBudgetError(
            f"no sharding plan fits the memory budget of {budget:.0f} bytes per rank on "
            f"{cost.world_size} ranks; plans need at least {_smallest_memory(graph):.0f} bytes. "
            "Raise memory_budget or use more ranks."
        )
    if result.x is None or result.status != 0:
        raise RuntimeError(f"the ILP solver (HiGHS) stopped: {result.message}")
    picks = []
    for i in range(len(nodes)):
        chosen = result.x[offsets[i] : offsets[i + 1]]
        picks.append(int(np.argmax(chosen)))
    return evaluate(graph, picks, cost)


def solve_graph(
    graph: ShardingGraph,
    cost: CostModel,
    *,
    memory_budget: float | None = None,
    chain: list[ChainNode] | None = None,
) -> DagPlan:
    """:func:`solve_ilp` when SciPy is installed; otherwise the chain dynamic program.

    Args:
        chain: the same problem as a chain (for the fallback); graphs built by
            :func:`~kolossos.auto_parallel.sharding_graph.chain_graph` pass theirs.

    Raises:
        ImportError: no SciPy and ``graph`` is not a chain (names ``pip install
            'kolossos[auto]'``).
        InfeasibleBudgetError: no plan fits.
    """
    if have_ilp_solver():
        return solve_ilp(graph, cost, memory_budget=memory_budget)
    if chain is None or not graph.is_chain:
        raise ImportError(
            "this graph has branches (residual connections, several inputs), which need the ILP "
            f"solver; install SciPy with {_INSTALL}. Chains are solved without it."
        )
    first, last = graph.nodes[0], graph.nodes[-1]
    plan = solve_chain(
        chain,
        cost,
        memory_budget=memory_budget,
        input_layouts=[s.out_layout for s in first.strategies],
        output_layouts=[s.in_layout for s in last.strategies],
    )
    picks = [next(i for i, s in enumerate(first.strategies) if s.out_layout == plan.input_layout)]
    for node, strategy in zip(chain, plan.strategies, strict=True):
        picks.append(list(node.strategies).index(strategy))
    # The loss's layout: the cheapest conversion from the last output (what the DP charged).
    budget = float("inf") if memory_budget is None else memory_budget
    tail = [evaluate(graph, [*picks, s], cost) for s in range(len(last.strategies))]
    fitting = [p for p in tail if p.memory <= budget] or tail
    return min(fitting, key=lambda p: (p.step_time, p.memory))
