"""Accounting tools for benchmarks and tests: a collective-traffic counter, per-rank memory, and
closed-form estimators (model-state bytes, communication volume, pipeline bubbles, FLOPs).

Example:
    >>> from kolossos.utils.profiling import CommCounter, MemoryMeter, model_state_bytes
    >>> with MemoryMeter() as meter, CommCounter() as comm:   # doctest: +SKIP
    ...     ...  # build, wrap, train; meter.mark_model_states() after optimizer.step()
    >>> meter.result().model_states / model_state_bytes(psi, "ddp", n, "fp32").total  # ~1.0
"""

from __future__ import annotations

from kolossos.utils.profiling.comm_counter import CollectiveStats, CommCounter, WireMeter
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
from kolossos.utils.profiling.memory import MemoryMeter, RankMemory, gather_from_ranks

__all__ = [
    "CollectiveStats",
    "CommCounter",
    "MemoryMeter",
    "ModelStateBytes",
    "PrecisionBytes",
    "RankMemory",
    "WireMeter",
    "bubble_fraction",
    "collective_sent_bytes",
    "comm_bytes_per_rank",
    "comm_volume_elements",
    "gather_from_ranks",
    "model_state_bytes",
    "precision_bytes",
    "transformer_train_flops_per_token",
]
