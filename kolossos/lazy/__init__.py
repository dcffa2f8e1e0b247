"""Lazy initialisation: build a model without allocating it, then materialise only what each rank
keeps (``LazyInitContext``, Colossal-AI's API)."""

from kolossos.lazy.context import LazyInitContext, LazyTensor
from kolossos.lazy.materialize import (
    is_lazy,
    is_lazy_module,
    lazy_named_tensors,
    materialize_module,
    materialize_on,
    module_tape,
    replay_tensors,
    swap_in,
)

__all__ = [
    "LazyInitContext",
    "LazyTensor",
    "is_lazy",
    "is_lazy_module",
    "lazy_named_tensors",
    "materialize_module",
    "materialize_on",
    "module_tape",
    "replay_tensors",
    "swap_in",
]
