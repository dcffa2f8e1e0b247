"""Plan search for transformers (GPT-2, LLaMA): the ILP over the whole traced
DAG, and the plan families :mod:`~kolossos.auto_parallel.apply_transformer` can execute.

* ``search_free`` — the unrestricted optimum over every strategy of every operator
  (:func:`~kolossos.auto_parallel.ilp.solve_ilp`); it may mix data and tensor parallelism.
* Executable families: ``dp`` (the ILP restricted to batch-sharded layouts: data
  parallelism), ``megatron`` (column ``c_attn``/``c_fc``, row ``c_proj``, heads sharded,
  vocabulary-parallel embedding, head and cross entropy, layer norms and residuals replicated —
  what ShardFormer's GPT-2 policy runs; LLaMA's ``q/k/v/gate/up_proj`` column, ``o/down_proj``
  row), ``replicated`` (every rank computes everything) and,
  on a 2-d ``dp × tp`` mesh, ``dp{dp}xtp{tp}`` (Megatron inside each ``tp`` group, data
  parallelism across them: :func:`hybrid_plan`). :func:`search_transformer_plan` returns the
  fastest that fits the budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from kolossos.auto_parallel.ilp import restrict, solve_ilp
from kolossos.auto_parallel.module_graph import OperatorGroup
from kolossos.auto_parallel.sharding_graph import DagPlan, ShardingGraph, evaluate
from kolossos.auto_parallel.solver import InfeasibleBudgetError
from kolossos.auto_parallel.strategies import CostModel, Layout
from kolossos.auto_parallel.transformer_strategies import megatron_assignment, transformer_graph

__all__ = [
    "FAMILIES",
    "family_plan",
    "family_plans",
    "format_dag_plan",
    "hybrid_plan",
    "parse_hybrid",
    "search_free",
    "search_transformer_plan",
]

FAMILIES = ("dp", "megatron", "replicated")
"""Plan families the executor implements."""


def _fixed(graph: ShardingGraph, groups: Sequence[OperatorGroup], names: list[set[str]],
           cost: CostModel) -> DagPlan:  # fmt: skip
    picks = []
    for node, group, wanted in zip(graph.nodes, groups, names, strict=True):
        found = [i for i, s in enumerate(node.strategies) if s.name in wanted]
        if not found:
            raise InfeasibleBudgetError(
                f"operator {group.name!r} ({group.kind}) has no strategy {sorted(wanted)}."
            )
        picks.append(found[0])
    return evaluate(graph, picks, cost)


def family_plan(family: str, groups: Sequence[OperatorGroup], cost: CostModel) -> DagPlan:
    """The best plan of one executable ``family`` (ignoring the budget)."""
    graph = transformer_graph(groups, cost)
    if family == "dp":
        batch: tuple[Layout, ...] = ("B",)
        return solve_ilp(restrict(graph, batch), cost)
    if family == "megatron":
        names = megatron_assignment(groups)
        return _fixed(graph, groups, names, cost)
    if family == "replicated":
        return _fixed(graph, groups, [{"R", "rep"} for _ in groups], cost)
    raise ValueError(f"family={family!r} must be one of {FAMILIES}.")


def hybrid_plan(local_groups: Sequence[OperatorGroup], cost: CostModel, dp: int) -> DagPlan:
    """The ``dp × tp`` plan on a 2-d mesh (``tp = world_size / dp``): the Megatron plan over
    each ``tp`` group on its ``1/dp`` of the batch (``local_groups``, traced at that batch),
    then one flat all-reduce of the (sharded) gradients over the ``dp`` group.

    Raises:
        ValueError: ``dp`` does not divide the world into two axes of at least 2.
    """
    world = cost.world_size
    if dp < 2 or world % dp or world // dp < 2:
        raise ValueError(f"dp={dp} must split {world} ranks into dp x tp with both >= 2.")
    tp_cost = replace(cost, world_size=world // dp)
    dp_cost = replace(cost, world_size=dp)
    base = family_plan("megatron", local_groups, tp_cost)
    held = sum(s.param_mem for s in base.strategies) / 4  # parameter bytes held per rank
    sync = dp_cost.all_reduce(held) + 2 * cost.copy_byte_s * held
    return DagPlan(
        nodes=base.nodes,
        strategies=base.strategies,
        reshard_s=base.reshard_s,
        step_time=base.step_time + sync,
        memory=max(base.memory, 4 * held + held),  # end of backward: plus the flat buffer
    )


def search_free(
    groups: Sequence[OperatorGroup], cost: CostModel, memory_budget: float | None = None
) -> DagPlan:
    """The ILP's optimum over every strategy (may mix families; not every such plan runs)."""
    return solve_ilp(transformer_graph(groups, cost), cost, memory_budget=memory_budget)


def family_plans(
    groups: Sequence[OperatorGroup],
    cost: CostModel,
    hybrid: Mapping[int, Sequence[OperatorGroup]] | None = None,
) -> dict[str, tuple[DagPlan, Sequence[OperatorGroup]]]:
    """Every executable family's best plan (ignoring the budget), with the operators it was
    priced on (a ``dp × tp`` family's are traced at ``1/dp`` of the batch)."""
    plans = {family: (family_plan(family, groups, cost), groups) for family in FAMILIES}
    for dp, local in (hybrid or {}).items():
        plans[f"dp{dp}xtp{cost.world_size // dp}"] = (hybrid_plan(local, cost, dp), local)
    return plans


def search_transformer_plan(
    groups: Sequence[OperatorGroup],
    cost: CostModel,
    memory_budget: float | None = None,
    hybrid: Mapping[int, Sequence[OperatorGroup]] | None = None,
) -> tuple[str, DagPlan]:
    """``(family, plan)``: the fastest executable family whose memory fits the budget.

    ``hybrid`` maps a data-parallel size ``dp`` to the operators traced at ``1/dp`` of the
    batch; each adds the family ``"dp{dp}xtp{tp}"`` (:func:`hybrid_plan`).

    Raises:
        InfeasibleBudgetError: no family fits (the message lists each family's memory).
    """
    budget = float("inf") if memory_budget is None else memory_budget
    plans = {f: plan for f, (plan, _) in family_plans(groups, cost, hybrid).items()}
    fitting = {f: p for f, p in plans.items() if p.memory <= budget}
    if not fitting:
        sizes = ", ".join(f"{f} {p.memory:.0f}" for f, p in plans.items())
        raise InfeasibleBudgetError(
            f"no executable plan fits the memory budget of {budget:.0f} bytes per rank on "
            f"{cost.world_size} ranks (bytes per rank: {sizes}). Raise memory_budget or use "
            "more ranks."
        )
    family = min(fitting, key=lambda f: (fitting[f].step_time, fitting[f].memory))
    return family, fitting[family]


def parse_hybrid(family: str) -> tuple[int, int] | None:
    """``(dp, tp)`` of a hybrid family name such as ``"dp2xtp2"``; ``None`` for the others."""
    if not family.startswith("dp") or "xtp" not in family:
        return None
    dp, tp = family[2:].split("xtp")
    return int(dp), int(tp)


def format_dag_plan(plan: DagPlan, graph: ShardingGraph) -> str:
    """The plan as a table: operator, kind, strategy, layouts, communication, memory."""
    lines = [
        f"{'operator':<30} {'kind':<22} {'strategy':<8} {'in->out':<8} {'comm ms':>8} "
        f"{'reshard ms':>10} {'param+opt MB':>12} {'act MB':>8}"
    ]
    for node, (_, s), move in zip(graph.nodes, plan, plan.reshard_s, strict=True):
        ins = ",".join(s.input_layout(k) for k in range(len(node.inputs))) or "-"
        lines.append(
            f"{node.name[-30:]:<30} {node.label[:22]:<22} {s.name:<8} "
            f"{ins + '->' + s.out_layout:<8} {s.comm_s * 1e3:>8.3f} {move * 1e3:>10.3f} "
            f"{s.param_mem / 2**20:>12.3f} {s.act_mem / 2**20:>8.3f}"
        )
    lines.append(
        f"predicted step time {plan.step_time * 1e3:.3f} ms, predicted memory per rank "
        f"{plan.memory / 2**20:.3f} MB"
    )
    return "\n".join(lines)
