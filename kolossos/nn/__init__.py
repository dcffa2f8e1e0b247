"""``kolossos.nn``: optimizers, learning-rate schedulers and layers under Colossal-AI's names.

Names resolve lazily (nothing heavy is imported with the package)::

    from kolossos.nn import Lamb, HybridAdam          # as colossalai.nn
    from kolossos.nn.optimizer import CPUAdam         # as colossalai.nn.optimizer
    from kolossos.nn.lr_scheduler import LinearWarmupLR
    import kolossos.nn as col_nn
    col_nn.Linear(256, 1024)                          # follows parallel.tensor of the launch config

Example:
    >>> import kolossos.nn as knn
    >>> knn.Lamb.__name__
    'Lamb'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kolossos.nn import layer, lr_scheduler, optimizer
    from kolossos.nn.layer.legacy import CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear
    from kolossos.nn.layer.parallel_1d import (
        Dropout1D,
        Embedding1D,
        Linear1D_Col,
        Linear1D_Row,
        VocabParallelEmbedding1D,
    )
    from kolossos.nn.optimizer import CPUAdam, FusedAdam, HybridAdam, Lamb, Lars

_OPTIMIZERS = ("CPUAdam", "FusedAdam", "HybridAdam", "Lamb", "Lars")
_LAYERS = ("CrossEntropyLoss", "Dropout", "Embedding", "LayerNorm", "Linear")
_LAYERS_1D = (
    "Dropout1D",
    "Embedding1D",
    "Linear1D_Col",
    "Linear1D_Row",
    "VocabParallelEmbedding1D",
)
_SUBMODULES = ("layer", "lr_scheduler", "optimizer")

__all__ = [
    "CPUAdam",
    "CrossEntropyLoss",
    "Dropout",
    "Dropout1D",
    "Embedding",
    "Embedding1D",
    "FusedAdam",
    "HybridAdam",
    "Lamb",
    "Lars",
    "LayerNorm",
    "Linear",
    "Linear1D_Col",
    "Linear1D_Row",
    "VocabParallelEmbedding1D",
    "layer",
    "lr_scheduler",
    "optimizer",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"kolossos.nn.{name}")
    elif name in _OPTIMIZERS:
        value = getattr(importlib.import_module("kolossos.nn.optimizer"), name)
    elif name in _LAYERS:
        value = getattr(importlib.import_module("kolossos.nn.layer.legacy"), name)
    elif name in _LAYERS_1D:
        value = getattr(importlib.import_module("kolossos.nn.layer.parallel_1d"), name)
    else:
        raise AttributeError(f"module 'kolossos.nn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
