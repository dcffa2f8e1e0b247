"""Colossal-AI's legacy config-driven layers (``kolossos.nn.Linear`` and friends)."""

from kolossos.nn.layer.legacy.layers import CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear
from kolossos.nn.layer.legacy.tp_context import (
    TensorParallelSettings,
    get_parallel_input,
    get_tensor_parallel_group,
    read_tensor_parallel_settings,
    set_parallel_input,
)

__all__ = [
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "TensorParallelSettings",
    "get_parallel_input",
    "get_tensor_parallel_group",
    "read_tensor_parallel_settings",
    "set_parallel_input",
]
