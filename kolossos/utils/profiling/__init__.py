"""Accounting tools for benchmarks and tests: a collective-traffic counter, per-rank memory, and
closed-form estimators (model-state bytes, communication volume, pipeline bubbles, FLOPs)."""

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

__all__ = [
    "CollectiveStats",
    "CommCounter",
    "ModelStateBytes",
    "PrecisionBytes",
    "WireMeter",
    "bubble_fraction",
    "collective_sent_bytes",
    "comm_bytes_per_rank",
    "comm_volume_elements",
    "model_state_bytes",
    "precision_bytes",
    "transformer_train_flops_per_token",
]
