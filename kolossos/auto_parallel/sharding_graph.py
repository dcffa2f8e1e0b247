"""The sharding problem over a whole traced graph (a DAG): nodes, their strategies, and plans.

A :class:`ShardingGraph` lists operators in topological order. Each :class:`DagNode` names the
nodes it reads (its inputs, in order) and holds its :class:`~kolossos.auto_parallel.strategies.
Strategy` list. Graph inputs are nodes without inputs whose strategies are the layouts the data
loader can give (zero cost); the loss is a *sink* node whose strategies are the layouts it
accepts. Choosing one strategy per node fixes every edge's source layout (the producer's
``out_layout``) and target layout (the consumer's :meth:`~Strategy.input_layout`); a mismatch
costs :func:`~kolossos.auto_parallel.strategies.reshard_cost` on the producer's output bytes, and
an edge into a sink that gathers a sharded tensor to ``R`` holds the gathered copy
(``bytes × (1 − 1/P)``).

:func:`evaluate` prices one assignment (its memory is the larger of the backward peak —
strategies' :attr:`~Strategy.memory` plus gathered copies — and the end of backward, the
strategies' :attr:`~Strategy.end_mem`); the ILP (:mod:`~kolossos.auto_parallel.ilp`) and the chain
dynamic program (:func:`~kolossos.auto_parallel.solver.solve_chain`) minimise it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kolossos.auto_parallel.solver import ChainNode, Plan, StrategyPlan
from kolossos.auto_parallel.strategies import CostModel, Layout, Strategy, reshard_cost

__all__ = [
    "INPUT",
    "OUTPUT",
    "DagNode",
    "DagPlan",
    "ShardingGraph",
    "chain_graph",
    "edge_cost",
    "evaluate",
    "layout_strategies",
]

INPUT = "input"
"""Name of the graph-input node :func:`chain_graph` adds."""
OUTPUT = "output"
"""Name of the loss (sink) node :func:`chain_graph` adds."""


@dataclass(frozen=True, kw_only=True)
class DagNode:
    """One operator: the nodes it reads, its full output bytes and its strategies."""

    name: str
    inputs: tuple[str, ...]
    strategies: Sequence[Strategy]
    out_bytes: float = 0.0
    sink: bool = False
    """A loss node: a gather into it holds the gathered copy (charged as memory)."""
    label: str = ""
    """What the node is (module path, operator) for printouts."""
    no_batch: bool = False
    """The output has no batch dimension (a position embedding, broadcast over the batch):
    read under ``B`` it is not sliced, but the readers' gradients are each rank's share, so
    moving it from ``R`` to ``B`` costs an all-reduce of its bytes in backward, and from ``B``
    to anything nothing."""
    tied_to: str = ""
    """A node owning a weight this node also uses (a tied embedding), or ``""``."""
    tie_allowed: Mapping[str, Collection[str]] = field(default_factory=dict)
    """For a tied node: the owner's strategy name → this node's strategy names that store and
    synchronise the shared weight the same way (the solvers allow only those pairs)."""


@dataclass(frozen=True)
class ShardingGraph:
    """Operators in topological order (every input defined before it is read)."""

    nodes: tuple[DagNode, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for node in self.nodes:
            if not node.strategies:
                raise ValueError(f"node {node.name!r} has no strategies.")
            for source in node.inputs:
                if source not in seen:
                    raise ValueError(
                        f"node {node.name!r} reads {source!r}, which is not defined before it; "
                        "list the nodes in topological order."
                    )
            if node.name in seen:
                raise ValueError(f"node name {node.name!r} appears twice.")
            if node.tied_to and node.tied_to not in seen:
                raise ValueError(
                    f"node {node.name!r} is tied to {node.tied_to!r}, which is not before it."
                )
            seen.add(node.name)

    def __getitem__(self, name: str) -> DagNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def edges(self) -> list[tuple[int, int, int]]:
        """``(producer index, consumer index, input slot)`` of every edge."""
        index = {n.name: i for i, n in enumerate(self.nodes)}
        return [
            (index[src], j, k)
            for j, node in enumerate(self.nodes)
            for k, src in enumerate(node.inputs)
        ]

    @property
    def is_chain(self) -> bool:
        """Every node reads only the node before it (the first reads nothing)."""
        return all(
            node.inputs == ((self.nodes[i - 1].name,) if i else ())
            for i, node in enumerate(self.nodes)
        )


@dataclass(frozen=True, kw_only=True)
class DagPlan(StrategyPlan):
    """The whole-graph solver's answer (a node's inputs may come from several nodes)."""

    def as_chain_plan(self) -> Plan:
        """The chain :class:`Plan` of a plan of :func:`chain_graph` (input and loss dropped)."""
        if self.nodes[0] != INPUT or self.nodes[-1] != OUTPUT:
            raise ValueError("as_chain_plan needs a plan of a graph built by chain_graph.")
        return Plan(
            nodes=self.nodes[1:-1],
            strategies=self.strategies[1:-1],
            input_layout=self.strategies[0].out_layout,
            reshard_s=self.reshard_s[1:-1],
            step_time=self.step_time,
            memory=self.memory,
        )


def layout_strategies(layouts: Collection[Layout]) -> list[Strategy]:
    """Zero-cost strategies, one per layout (graph inputs and loss sinks)."""
    return [
        Strategy(
            name=layout,
            in_layout=layout,
            out_layout=layout,
            compute_s=0.0,
            comm_s=0.0,
            comm_bytes=0.0,
            param_mem=0.0,
            act_mem=0.0,
        )
        for layout in layouts
    ]


def edge_cost(
    src: Layout,
    dst: Layout,
    num_bytes: float,
    cost: CostModel,
    *,
    into_sink: bool,
    no_batch: bool = False,
) -> tuple[float, float]:
    """(time, memory) of moving a tensor of ``num_bytes`` from layout ``src`` to ``dst``
    (``no_batch``: a tensor broadcast over the batch, see :attr:`DagNode.no_batch`)."""
    if no_batch and src == "R" and dst == "B":
        time = cost.all_reduce(num_bytes) if cost.world_size > 1 else 0.0
    elif no_batch and src == "B":  # whole on every rank already: nothing to gather
        time = 0.0
    else:
        time = reshard_cost(src, dst, num_bytes, cost)
    memory = num_bytes * (1 - 1 / cost.world_size) if into_sink and dst == "R" != src else 0.0
    return time, memory


def evaluate(graph: ShardingGraph, picks: Sequence[int], cost: CostModel) -> DagPlan:
    """The plan choosing strategy ``picks[i]`` for node ``i``, with its time and memory."""
    if len(picks) != len(graph.nodes):
        raise ValueError(f"{len(picks)} picks for {len(graph.nodes)} nodes.")
    chosen = [node.strategies[p] for node, p in zip(graph.nodes, picks, strict=True)]
    time = sum(s.time for s in chosen)
    memory = sum(s.memory for s in chosen)
    end = sum(s.end_mem for s in chosen)
    moves = [0.0] * len(chosen)
    for i, j, k in graph.edges():
        t, m = edge_cost(
            chosen[i].out_layout,
            chosen[j].input_layout(k),
            graph.nodes[i].out_bytes,
            cost,
            into_sink=graph.nodes[j].sink,
            no_batch=graph.nodes[i].no_batch,
        )
        moves[j] += t
        time += t
        memory += m
    return DagPlan(
        nodes=tuple(n.name for n in graph.nodes),
        strategies=tuple(chosen),
        reshard_s=tuple(moves),
        step_time=time,
        memory=max(memory, end),
    )


def chain_graph(
    chain: Sequence[ChainNode],
    *,
    input_layouts: Collection[Layout] = ("B", "R"),
    output_layouts: Collection[Layout] = ("B", "R"),
) -> ShardingGraph:
    """The chain as a graph: an :data:`INPUT` node, the operators, an :data:`OUTPUT` sink.

    Its optimum equals :func:`~kolossos.auto_parallel.solver.solve_chain`'s with the same
    input and output layouts.
    """
    if not chain:
        raise ValueError("chain_graph needs at least one node.")
    nodes = [
        DagNode(
            name=INPUT,
            inputs=(),
            strategies=layout_strategies(input_layouts),
            out_bytes=chain[0].in_bytes,
        )
    ]
    previous = INPUT
    for node in chain:
        nodes.append(
            DagNode(
                name=node.name,
                inputs=(previous,),
                strategies=node.strategies,
                out_bytes=node.out_bytes,
            )
        )
        previous = node.name
    nodes.append(
        DagNode(
            name=OUTPUT,
            inputs=(previous,),
            strategies=layout_strategies(output_layouts),
            sink=True,
        )
    )
    return ShardingGraph(tuple(nodes))
