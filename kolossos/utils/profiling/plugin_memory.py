"""Per-rank memory of a training step under each plugin, as kolossos implements it.

The phases of each plugin come from its own module: :mod:`~kolossos.utils.profiling.dp_memory`
(``TorchDDPPlugin``, ``LowLevelZeroPlugin``), :mod:`~kolossos.utils.profiling.sharded_memory`
(``GeminiPlugin``, ``TorchFSDPPlugin``) and :mod:`~kolossos.utils.profiling.hybrid_memory`
(``HybridParallelPlugin``); ``docs/plan.md`` says what each one counts.

Example:
    >>> from kolossos.utils.profiling.layouts import Layout
    >>> from kolossos.utils.profiling.model_shape import load_model_shape
    >>> work = Workload(shape=load_model_shape("gpt2-tiny"), seq_len=64, batch=8)
    >>> estimate_memory(Layout(plugin="ddp", precision="fp32", dp=2), work).peak_phase
    'loss'
"""

from __future__ import annotations

from kolossos.utils.profiling.dp_memory import ddp_phases, zero_plugin_phases
from kolossos.utils.profiling.hybrid_memory import hybrid_estimate
from kolossos.utils.profiling.layouts import Layout
from kolossos.utils.profiling.memory_phases import DEVICES, MemoryEstimate, Workload
from kolossos.utils.profiling.rank_model import rank_models
from kolossos.utils.profiling.sharded_memory import fsdp_phases, gemini_phases

__all__ = ["estimate_memory"]

_BUILDERS = {"ddp": ddp_phases, "zero": zero_plugin_phases, "gemini": gemini_phases,
             "fsdp": fsdp_phases}  # fmt: skip


def estimate_memory(layout: Layout, work: Workload) -> MemoryEstimate:
    """The per-rank memory of training ``work`` with ``layout`` (the worst rank's).

    Raises:
        ValueError: an unknown plugin or device.
    """
    if work.device not in DEVICES:
        raise ValueError(f"device={work.device!r} must be one of {DEVICES}.")
    if layout.plugin == "hybrid":
        return hybrid_estimate(layout, work)
    if layout.plugin not in _BUILDERS:
        raise ValueError(f"plugin={layout.plugin!r} must be one of {sorted(_BUILDERS)}, hybrid.")
    (rank,) = rank_models(work.shape)
    return MemoryEstimate.of(_BUILDERS[layout.plugin](layout, work, rank))
