"""Auto-parallel (Colossal-Auto), first part: the tracer and the activation-checkpoint search.

* :class:`ColoTracer` traces a model on meta inputs into a graph with shape, dtype, bytes and
  FLOPs per node.
* :mod:`kolossos.auto_parallel.checkpoint` holds :class:`CheckpointSolverRotor`, a Rotor-style
  dynamic program choosing which segments of a chain of blocks to recompute under an activation
  memory budget, and the code that applies its plan with ``torch.utils.checkpoint``.

* :func:`autoparallelize` on a 1-d mesh: for MLP chains, per-operator strategies
  (:mod:`~kolossos.auto_parallel.strategies`), a dynamic-programming solver under a per-rank
  memory budget (:mod:`~kolossos.auto_parallel.solver`) and the plan applied with DTensor
  column/row parallel styles or data parallelism (:mod:`~kolossos.auto_parallel.apply`); for
  Hugging Face GPT-2 and LLaMA, an ILP over the whole traced DAG
  (:mod:`~kolossos.auto_parallel.ilp`, SciPy's HiGHS, ``pip install 'kolossos[auto]'``) and data
  parallel, Megatron (ShardFormer) or replicated execution
  (:mod:`~kolossos.auto_parallel.apply_transformer`), any per-operator plan of the ILP run by
  rewriting the traced graph for each rank (:mod:`~kolossos.auto_parallel.apply_graph`), with
  the model's blocks recomputed when no plan fits the memory budget
  (:mod:`~kolossos.auto_parallel.transformer_checkpoint`). See ``docs/auto_parallel.md``.
"""

from __future__ import annotations

from kolossos.auto_parallel.apply import AutoParallelModule
from kolossos.auto_parallel.apply_graph import AutoParallelGraph, apply_graph_plan
from kolossos.auto_parallel.apply_transformer import AutoParallelTransformer
from kolossos.auto_parallel.autoparallelize import autoparallelize
from kolossos.auto_parallel.ilp import solve_graph, solve_ilp
from kolossos.auto_parallel.sharding_graph import DagNode, DagPlan, ShardingGraph
from kolossos.auto_parallel.solver import InfeasibleBudgetError, Plan, solve_chain
from kolossos.auto_parallel.strategies import CostModel, UnsupportedOperatorError
from kolossos.auto_parallel.traced_graph import NodeInfo, TracedGraph, TracingError
from kolossos.auto_parallel.tracer import ColoTracer

__all__ = [
    "AutoParallelGraph",
    "AutoParallelModule",
    "AutoParallelTransformer",
    "ColoTracer",
    "CostModel",
    "DagNode",
    "DagPlan",
    "InfeasibleBudgetError",
    "NodeInfo",
    "Plan",
    "ShardingGraph",
    "TracedGraph",
    "TracingError",
    "UnsupportedOperatorError",
    "apply_graph_plan",
    "autoparallelize",
    "solve_chain",
    "solve_graph",
    "solve_ilp",
]
