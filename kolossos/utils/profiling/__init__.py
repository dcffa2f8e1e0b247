"""Accounting tools for benchmarks and tests: a collective-traffic counter, per-rank memory, and
closed-form estimators (model-state bytes, communication volume, pipeline bubbles, FLOPs); and
the memory planner behind ``kolossos plan`` (model shapes, per-plugin memory, layouts).

Example:
    >>> from kolossos.utils.profiling import CommCounter, MemoryMeter, model_state_bytes
    >>> with MemoryMeter() as meter, CommCounter() as comm:   # doctest: +SKIP
    ...     ...  # build, wrap, train; meter.mark_model_states() after optimizer.step()
    >>> meter.result().model_states / model_state_bytes(psi, "ddp", n, "fp32").total  # ~1.0
"""

from __future__ import annotations

from kolossos.utils.profiling.comm_counter import CollectiveStats, CommCounter, WireMeter
from kolossos.utils.profiling.comm_estimate import CommEstimate, comm_estimate
from kolossos.utils.profiling.estimators import (
    ModelStateBytes,
    PrecisionBytes,
    bubble_fraction,
    collective_sent_bytes,
    comm_bytes_per_rank,
    comm_volume_elements,
    model_state_bytes,
    precision_bytes,
    transformer_train_flops_per_token,
)
from kolossos.utils.profiling.layouts import Layout, candidate_layouts
from kolossos.utils.profiling.memory import MemoryMeter, RankMemory, gather_from_ranks
from kolossos.utils.profiling.memory_phases import MemoryEstimate, Workload
from kolossos.utils.profiling.model_params import count_parameters, parameter_specs
from kolossos.utils.profiling.model_shape import ModelShape, load_model_shape, shape_from_config
from kolossos.utils.profiling.planner import Plan, PlanRequest, make_plan
from kolossos.utils.profiling.plugin_memory import estimate_memory

__all__ = [
    "CollectiveStats",
    "CommCounter",
    "CommEstimate",
    "Layout",
    "MemoryEstimate",
    "MemoryMeter",
    "ModelShape",
    "ModelStateBytes",
    "Plan",
    "PlanRequest",
    "PrecisionBytes",
    "RankMemory",
    "WireMeter",
    "Workload",
    "bubble_fraction",
    "candidate_layouts",
    "collective_sent_bytes",
    "comm_bytes_per_rank",
    "comm_estimate",
    "comm_volume_elements",
    "count_parameters",
    "estimate_memory",
    "gather_from_ranks",
    "load_model_shape",
    "make_plan",
    "model_state_bytes",
    "parameter_specs",
    "precision_bytes",
    "shape_from_config",
    "transformer_train_flops_per_token",
]
