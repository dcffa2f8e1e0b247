"""Colossal-AI's ``colossalai.shardformer.layer``: the tensor-parallel building blocks under
their Colossal-AI names.

Where kolossos has the same layer, the name is that class itself (``Linear1D_Col`` is
:class:`kolossos.nn.layer.parallel_1d.Linear1D_Col`), whose constructor takes Colossal-AI's
keywords (``seq_parallel``, ``seq_parallel_dim``, ``overlap``, ``weight_initializer``, ...) next
to kolossos' own. See docs/tp_layers.md ("Colossal-AI names") for what differs.

Example:
    >>> from kolossos.shardformer.layer import Linear1D_Col, Linear1D_Row
    >>> up = Linear1D_Col.from_native_module(mlp.fc1, group, seq_parallel=True)  # doctest: +SKIP
    >>> down = Linear1D_Row.from_native_module(mlp.fc2, group, seq_parallel=True)  # doctest: +SKIP
"""

from kolossos.shardformer.layer.dropout import DropoutForParallelInput, DropoutForReplicatedInput
from kolossos.shardformer.layer.embedding import Embedding1D, VocabParallelEmbedding1D
from kolossos.shardformer.layer.linear import Linear1D_Col, Linear1D_Row
from kolossos.shardformer.layer.loss import cross_entropy_1d
from kolossos.shardformer.layer.normalization import (
    BaseLayerNorm,
    FusedLayerNorm,
    FusedRMSNorm,
    LayerNorm,
    RMSNorm,
)
from kolossos.shardformer.layer.parallel_module import ParallelModule
from kolossos.shardformer.layer.qkv_fused_linear import (
    FusedLinear1D_Col,
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
)

__all__ = [
    "BaseLayerNorm",
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "Embedding1D",
    "FusedLayerNorm",
    "FusedLinear1D_Col",
    "FusedRMSNorm",
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "LayerNorm",
    "Linear1D_Col",
    "Linear1D_Row",
    "ParallelModule",
    "RMSNorm",
    "VocabParallelEmbedding1D",
    "cross_entropy_1d",
]
