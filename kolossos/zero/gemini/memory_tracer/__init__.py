"""Gemini's memory tracer: what a warm-up iteration teaches the placement policy.

:class:`MemStatsCollector` samples the peak non-model memory of every period between compute
moments and records which chunks each moment computes; the result, :class:`MemStats`, drives the
``auto`` policy's device reservations and its evict-latest-next-use rule. On a GPU the samples come
from the caching allocator; on the CPU from a :class:`~kolossos.accelerator.TensorMemoryTracker`,
with chunk allocations labelled by :func:`model_data_scope`.
"""

from kolossos.zero.gemini.memory_tracer.collector import MemStatsCollector
from kolossos.zero.gemini.memory_tracer.memstats import MemStats
from kolossos.zero.gemini.memory_tracer.sampler import (
    AllocatorSampler,
    MemorySampler,
    TrackerSampler,
    default_sampler,
)
from kolossos.zero.gemini.memory_tracer.scope import MODEL_DATA, model_data_scope

__all__ = [
    "MODEL_DATA",
    "AllocatorSampler",
    "MemStats",
    "MemStatsCollector",
    "MemorySampler",
    "TrackerSampler",
    "default_sampler",
    "model_data_scope",
]
