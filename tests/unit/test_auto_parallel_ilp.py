"""The ILP sharding solver: equal to the chain DP on chains, to brute force on branched graphs."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from kolossos.auto_parallel import ilp
from kolossos.auto_parallel.autoparallelize import build_chain
from kolossos.auto_parallel.ilp import restrict, solve_graph, solve_ilp
from kolossos.auto_parallel.sharding_graph import (
    DagNode,
    ShardingGraph,
    chain_graph,
    evaluate,
    layout_strategies,
)
from kolossos.auto_parallel.solver import InfeasibleBudgetError, solve_chain
from kolossos.auto_parallel.strategies import CostModel, Strategy

LAYOUTS = ("B", "R", "F")


def _mlp(hidden: int, layers: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.LayerNorm(hidden) if i % 2 else nn.ReLU()]
    return nn.Sequential(*blocks)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fraction", [None, 0.0, 0.3, 0.6, 0.9])
def test_ilp_equals_dp_on_chains(world_size: int, fraction: float | None) -> None:
    cost = CostModel(world_size=world_size, flops_per_s=1e10, alpha=1e-4, beta=1e-9)
    meta = {"input": torch.empty(256, 64, device="meta")}
    chain, _ = build_chain(_mlp(64, 4), meta, cost)
    lean = solve_chain(chain, cost, allowed_layouts=("R", "F"), input_layouts=("R",)).memory
    fast = solve_chain(chain, cost).memory
    budget = None if fraction is None else lean * 0.999 + fraction * (fast - lean)
    try:
        dp = solve_chain(chain, cost, memory_budget=budget)
    except InfeasibleBudgetError:
        with pytest.raises(InfeasibleBudgetError):
            solve_ilp(chain_graph(chain), cost, memory_budget=budget)
        return
    plan = solve_ilp(chain_graph(chain), cost, memory_budget=budget).as_chain_plan()
    assert plan.step_time == pytest.approx(dp.step_time, rel=1e-7)
    assert budget is None or plan.memory <= budget


def _random_strategy(rng: random.Random, inputs: int) -> Strategy:
    return Strategy(
        name=f"s{rng.randrange(1000)}",
        in_layout=rng.choice(LAYOUTS),
        out_layout=rng.choice(LAYOUTS),
        in_layouts=tuple(rng.choice(LAYOUTS) for _ in range(inputs)) if inputs > 1 else (),
        compute_s=rng.uniform(0, 1e-3),
        comm_s=rng.uniform(0, 1e-3),
        comm_bytes=0.0,
        param_mem=rng.uniform(0, 1e6),
        act_mem=rng.uniform(0, 1e6),
        end_mem=rng.uniform(0, 2e6) if rng.random() < 0.5 else 0.0,
    )


def _random_dag(seed: int) -> ShardingGraph:
    rng = random.Random(seed)
    nodes = [DagNode(name="x", inputs=(), strategies=layout_strategies(("B", "R")),
                     out_bytes=rng.uniform(1e5, 1e6))]  # fmt: skip
    for i in range(rng.randint(4, 5)):
        names = [n.name for n in nodes]
        inputs = tuple(rng.sample(names, k=min(len(names), rng.choice((1, 2)))))
        nodes.append(
            DagNode(
                name=f"n{i}",
                inputs=inputs,
                strategies=[_random_strategy(rng, len(inputs)) for _ in range(rng.randint(1, 3))],
                out_bytes=rng.uniform(1e5, 1e6),
            )
        )
    sinks = tuple(n.name for n in nodes[-2:])
    nodes.append(DagNode(name="loss", inputs=sinks, strategies=layout_strategies(("B", "R")),
                         sink=True))  # fmt: skip
    return ShardingGraph(tuple(nodes))


@pytest.mark.parametrize("seed", range(8))
def test_ilp_equals_brute_force_on_branched_graphs(seed: int) -> None:
    graph = _random_dag(seed)
    assert not graph.is_chain
    cost = CostModel(world_size=4, flops_per_s=1e10, alpha=1e-4, beta=1e-9)
    plans = [
        evaluate(graph, picks, cost)
        for picks in itertools.product(*(range(len(n.strategies)) for n in graph.nodes))
    ]
    memories = sorted(p.memory for p in plans)
    for budget in (None, memories[len(memories) // 2], memories[len(memories) // 10]):
        fitting = [p for p in plans if budget is None or p.memory <= budget]
        best = min(p.step_time for p in fitting)
        found = solve_ilp(graph, cost, memory_budget=budget)
        assert found.step_time == pytest.approx(best, rel=1e-7, abs=1e-12)
        assert budget is None or found.memory <= budget * (1 + 1e-9)
    with pytest.raises(InfeasibleBudgetError, match="need at least"):
        solve_ilp(graph, cost, memory_budget=memories[0] * 0.5)


def test_restrict_names_the_node() -> None:
    graph = _random_dag(0)
    with pytest.raises(InfeasibleBudgetError, match="no strategy with layouts"):
        restrict(graph, ("Q",))  # type: ignore[arg-type]


def test_without_scipy_chains_fall_back_and_branches_name_the_extra(monkeypatch) -> None:
    monkeypatch.setattr(ilp, "have_ilp_solver", lambda: False)
    cost = CostModel(world_size=2, flops_per_s=1e10, alpha=1e-4, beta=1e-9)
    chain, _ = build_chain(_mlp(32, 2), {"input": torch.empty(64, 32, device="meta")}, cost)
    plan = solve_graph(chain_graph(chain), cost, chain=chain)
    assert plan.step_time == pytest.approx(solve_chain(chain, cost).step_time)
    with pytest.raises(ImportError, match=r"pip install 'kolossos\[auto\]'"):
        solve_graph(_random_dag(1), cost)
