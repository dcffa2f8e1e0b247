"""Auto-parallel (Colossal-Auto), first part: the tracer and the activation-checkpoint search.

* :class:`ColoTracer` traces a model on meta inputs into a graph with shape, dtype, bytes and
  FLOPs per node.
* :mod:`kolossos.auto_parallel.checkpoint` holds :class:`CheckpointSolverRotor`, a Rotor-style
  dynamic program choosing which segments of a chain of blocks to recompute under an activation
  memory budget, and the code that applies its plan with ``torch.utils.checkpoint``.

* :func:`autoparallelize` (first version, MLP chains on a 1-d mesh): per-operator strategies
  (:mod:`~kolossos.auto_parallel.strategies`), a dynamic-programming solver under a per-rank
  memory budget (:mod:`~kolossos.auto_parallel.solver`) and the plan applied with DTensor
  column/row parallel styles or data parallelism (:mod:`~kolossos.auto_parallel.apply`). See
  ``docs/auto_parallel.md``.
"""

from __future__ import annotations

from kolossos.auto_parallel.apply import AutoParallelModule
from kolossos.auto_parallel.autoparallelize import autoparallelize
from kolossos.auto_parallel.solver import InfeasibleBudgetError, Plan, solve_chain
from kolossos.auto_parallel.strategies import CostModel, UnsupportedOperatorError
from kolossos.auto_parallel.traced_graph import NodeInfo, TracedGraph, TracingError
from kolossos.auto_parallel.tracer import ColoTracer

__all__ = [
    "AutoParallelModule",
    "ColoTracer",
    "CostModel",
    "InfeasibleBudgetError",
    "NodeInfo",
    "Plan",
    "TracedGraph",
    "TracingError",
    "UnsupportedOperatorError",
    "autoparallelize",
    "solve_chain",
]
