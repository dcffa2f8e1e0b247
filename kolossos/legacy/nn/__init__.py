"""Colossal-AI's ``colossalai.legacy.nn``: the config-driven layers and loss
(:mod:`kolossos.legacy.nn.layer.colossalai_layer`), the tensor-parallel layers of each mode
(:mod:`.layer`), the losses (:mod:`.loss`) and the metrics (:mod:`.metric`).

Example:
    >>> from kolossos.legacy.nn.metric import Accuracy
    >>> import kolossos.legacy.nn as col_nn
    >>> col_nn.metric.Accuracy is Accuracy
    True
"""

from kolossos.legacy.nn import loss, metric
from kolossos.legacy.nn.layer.colossalai_layer import (
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
)
from kolossos.legacy.nn.wrapper import PipelineSharedModuleWrapper

__all__ = [
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "PipelineSharedModuleWrapper",
    "loss",
    "metric",
]
