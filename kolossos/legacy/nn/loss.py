"""Colossal-AI's losses (``colossalai.legacy.nn.loss``): ``CrossEntropyLoss`` follows the launch
config's tensor parallelism (it lives with the other config-driven layers in
:mod:`kolossos.legacy.nn.layer.colossalai_layer`, also ``kolossos.nn.CrossEntropyLoss``); each
multi-dimensional mode has its own pair (whole-class and vocabulary-parallel logits)."""

from kolossos.legacy.nn.layer.colossalai_layer import CrossEntropyLoss
from kolossos.legacy.nn.layer.parallel_2d import (
    CrossEntropyLoss2D,
    VocabParallelCrossEntropyLoss2D,
)
from kolossos.legacy.nn.layer.parallel_2p5d import (
    CrossEntropyLoss2p5D,
    VocabParallelCrossEntropyLoss2p5D,
)
from kolossos.legacy.nn.layer.parallel_3d import (
    CrossEntropyLoss3D,
    VocabParallelCrossEntropyLoss3D,
)

__all__ = [
    "CrossEntropyLoss",
    "CrossEntropyLoss2D",
    "CrossEntropyLoss2p5D",
    "CrossEntropyLoss3D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelCrossEntropyLoss2p5D",
    "VocabParallelCrossEntropyLoss3D",
]
