"""Auto-parallel (Colossal-Auto), first part: the tracer and the activation-checkpoint search.

* :class:`ColoTracer` traces a model on meta inputs into a graph with shape, dtype, bytes and
  FLOPs per node.
* :mod:`kolossos.auto_parallel.checkpoint` holds :class:`CheckpointSolverRotor`, a Rotor-style
  dynamic program choosing which segments of a chain of blocks to recompute under an activation
  memory budget, and the code that applies its plan with ``torch.utils.checkpoint``.

The sharding-strategy solver and :func:`autoparallelize` are not built yet (see
``docs/auto_parallel.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from kolossos.auto_parallel.traced_graph import NodeInfo, TracedGraph, TracingError
from kolossos.auto_parallel.tracer import ColoTracer

__all__ = ["ColoTracer", "NodeInfo", "TracedGraph", "TracingError", "autoparallelize"]


def autoparallelize(
    model: torch.nn.Module,
    meta_input_samples: Any = None,
    device_mesh: Any = None,
    memory_budget: float | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """Colossal-Auto's one-line entry point: not implemented yet.

    Raises:
        NotImplementedError: always; the sharding-strategy solver it needs is not built.
    """
    raise NotImplementedError(
        "autoparallelize is not implemented in kolossos yet: the per-operator sharding-strategy "
        "solver is not built. What exists: ColoTracer (kolossos.auto_parallel) and the "
        "activation-checkpoint search (kolossos.auto_parallel.checkpoint.CheckpointSolverRotor). "
        "Use a Booster plugin (e.g. HybridParallelPlugin) for parallel training meanwhile."
    )
