"""Labelling model-data allocations so that CPU memory sampling can tell them from the rest.

On a CPU there are no allocator statistics: :class:`~kolossos.accelerator.TensorMemoryTracker`
counts tensor storages instead, and everything it sees is one pool. Code that allocates chunk
memory (gather buffers, moved shards, gradient chunks) runs inside :func:`model_data_scope`, which
bills those storages to :data:`MODEL_DATA`; what remains is non-model data. Outside an active CPU
tracker the scope does nothing and costs one lookup.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kolossos.accelerator import active_tracker

__all__ = ["MODEL_DATA", "model_data_scope"]

#: tracker category of Gemini's chunk storages
MODEL_DATA = "gemini_model_data"


@contextlib.contextmanager
def model_data_scope() -> Iterator[None]:
    """Bill storages allocated inside the block to :data:`MODEL_DATA` in the active tracker.

    Example:
        >>> with model_data_scope():
        ...     payload = torch.empty(chunk_numel, dtype=torch.float16)
    """
    tracker = active_tracker()
    if tracker is None:
        yield
        return
    with tracker.category(MODEL_DATA):
        yield
