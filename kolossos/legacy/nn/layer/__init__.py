"""Colossal-AI's tensor-parallel layer packages (``colossalai.legacy.nn.layer``): one module per
mode, each taking its process groups from the launch's ``gpc``.

Example:
    >>> from kolossos.legacy.nn.layer.parallel_2d import Linear2D  # doctest: +SKIP
"""

from kolossos.legacy.nn.layer.parallel_2d import (
    Classifier2D,
    Dropout2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    PatchEmbedding2D,
    VocabParallelClassifier2D,
    VocabParallelEmbedding2D,
    reduce_by_batch_2d,
    split_batch_2d,
)
from kolossos.legacy.nn.layer.parallel_2p5d import (
    Classifier2p5D,
    Dropout2p5D,
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    PatchEmbedding2p5D,
    VocabParallelClassifier2p5D,
    VocabParallelEmbedding2p5D,
    reduce_by_batch_2p5d,
    split_batch_2p5d,
    split_tensor_2p5d,
)
from kolossos.legacy.nn.layer.parallel_3d import (
    Classifier3D,
    Dropout3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    PatchEmbedding3D,
    VocabParallelClassifier3D,
    VocabParallelEmbedding3D,
    reduce_by_batch_3d,
    split_batch_3d,
    split_tensor_3d,
)

__all__ = [
    "Classifier2D",
    "Classifier2p5D",
    "Classifier3D",
    "Dropout2D",
    "Dropout2p5D",
    "Dropout3D",
    "Embedding2D",
    "Embedding2p5D",
    "Embedding3D",
    "LayerNorm2D",
    "LayerNorm2p5D",
    "LayerNorm3D",
    "Linear2D",
    "Linear2p5D",
    "Linear3D",
    "PatchEmbedding2D",
    "PatchEmbedding2p5D",
    "PatchEmbedding3D",
    "VocabParallelClassifier2D",
    "VocabParallelClassifier2p5D",
    "VocabParallelClassifier3D",
    "VocabParallelEmbedding2D",
    "VocabParallelEmbedding2p5D",
    "VocabParallelEmbedding3D",
    "reduce_by_batch_2d",
    "reduce_by_batch_2p5d",
    "reduce_by_batch_3d",
    "split_batch_2d",
    "split_batch_2p5d",
    "split_batch_3d",
    "split_tensor_2p5d",
    "split_tensor_3d",
]
