"""2D (SUMMA) tensor parallelism on a ``q x q`` grid of ranks (Optimus, arXiv:2104.05343).

Activations and weights are both split in two dimensions: rank ``(i, j)`` holds batch block
``i`` and feature block ``j`` of every activation, and block ``(i, j)`` of every weight matrix,
so computation, parameter memory and activation memory all scale as ``1/q²``. The layers take
their process groups explicitly as a :class:`Groups2D` (this rank's row and column groups);
Colossal-AI's ``gpc``-driven names live in :mod:`kolossos.legacy.nn.layer.parallel_2d`.

Every layer builds its blocks from the dense layer's initialisation (same seed, same full
matrix), marks them with a :class:`Shard2DSpec`, and gathers them back with ``full_state()``
under the dense module's names (``load_full_state`` loads a dense state dict).

Example:
    >>> from kolossos.nn.layer.parallel_2d import Groups2D, Linear2D, split_batch_2d
    >>> groups = Groups2D(row=row_group, col=col_group)  # doctest: +SKIP
    >>> fc = Linear2D(256, 1024, groups=groups)  # weight [128, 512] on 4 ranks  # doctest: +SKIP
    >>> x_ij = split_batch_2d(x, groups).chunk(2, -1)[groups.col_index]  # doctest: +SKIP
    >>> fc(x_ij).shape  # x: [16, 256]  # doctest: +SKIP
    torch.Size([8, 512])
"""

from kolossos.nn.layer.parallel_2d._base import ParallelModule2D
from kolossos.nn.layer.parallel_2d._comm import (
    gather_weight_2d,
    reduce_by_batch_2d,
    reduce_scatter_2d,
    split_batch_2d,
)
from kolossos.nn.layer.parallel_2d.dropout import Dropout2D, ensure_2d_rng_stream
from kolossos.nn.layer.parallel_2d.embedding import (
    Embedding2D,
    PatchEmbedding2D,
    VocabParallelEmbedding2D,
)
from kolossos.nn.layer.parallel_2d.grid import Groups2D, check_divisible, summa_dim
from kolossos.nn.layer.parallel_2d.linear import Classifier2D, Linear2D, VocabParallelClassifier2D
from kolossos.nn.layer.parallel_2d.loss import (
    Accuracy2D,
    CrossEntropyLoss2D,
    VocabParallelCrossEntropyLoss2D,
)
from kolossos.nn.layer.parallel_2d.norm import LayerNorm2D, layer_norm_2d
from kolossos.nn.layer.parallel_2d.sharding import (
    Shard2DSpec,
    gather_2d_full,
    get_2d_spec,
    is_2d_sharded,
    set_2d_spec,
    slice_2d_shard,
)
from kolossos.nn.layer.parallel_2d.summa import summa_ab, summa_abt, summa_atb

__all__ = [
    "Accuracy2D",
    "Classifier2D",
    "CrossEntropyLoss2D",
    "Dropout2D",
    "Embedding2D",
    "Groups2D",
    "LayerNorm2D",
    "Linear2D",
    "ParallelModule2D",
    "PatchEmbedding2D",
    "Shard2DSpec",
    "VocabParallelClassifier2D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelEmbedding2D",
    "check_divisible",
    "ensure_2d_rng_stream",
    "gather_2d_full",
    "gather_weight_2d",
    "get_2d_spec",
    "is_2d_sharded",
    "layer_norm_2d",
    "reduce_by_batch_2d",
    "reduce_scatter_2d",
    "set_2d_spec",
    "slice_2d_shard",
    "split_batch_2d",
    "summa_ab",
    "summa_abt",
    "summa_atb",
    "summa_dim",
]
