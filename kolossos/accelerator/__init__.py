"""Device abstraction: which device a rank computes on, how ranks talk, and how much memory is used.

Library code never calls ``.cuda()`` or ``torch.cuda`` directly; it asks :func:`get_accelerator`::

    from kolossos.accelerator import get_accelerator

    acc = get_accelerator()  # CudaAccelerator with nccl, or CpuAccelerator with gloo
    model.to(acc.get_current_device())
    peak = acc.max_memory_allocated()

On the CPU, exact memory figures come from a :class:`TensorMemoryTracker` (see ``docs/memory.md``).
"""

from __future__ import annotations

from kolossos.accelerator.api import (
    ACCELERATOR_ENV,
    ACCELERATOR_TYPES,
    auto_set_accelerator,
    get_accelerator,
    set_accelerator,
)
from kolossos.accelerator.base_accelerator import BaseAccelerator
from kolossos.accelerator.cpu_accelerator import CpuAccelerator
from kolossos.accelerator.cuda_accelerator import CudaAccelerator
from kolossos.accelerator.memory_tracker import (
    ACTIVATIONS,
    BUFFERS,
    GRADS,
    OPTIM,
    OTHER,
    PARAMS,
    TensorMemoryTracker,
    active_tracker,
)

__all__ = [
    "ACCELERATOR_ENV",
    "ACCELERATOR_TYPES",
    "ACTIVATIONS",
    "BUFFERS",
    "GRADS",
    "OPTIM",
    "OTHER",
    "PARAMS",
    "BaseAccelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "TensorMemoryTracker",
    "active_tracker",
    "auto_set_accelerator",
    "get_accelerator",
    "set_accelerator",
]
