"""2.5D (Tesseract) tensor parallelism on ``P = q * q * d`` ranks, with explicit process groups
(:class:`Groups2p5D`).

The activations are split into ``d * q`` batch blocks and ``q`` feature blocks; the weights into
``q x q`` blocks replicated over the ``d`` depth layers; each depth layer runs SUMMA on its own
batch blocks and the weight gradients are summed over the depth layers. Every layer builds its
shards from the dense layer's initialisation (same seed, same full matrix), gathers them back
with ``full_state()`` (the dense layer's names and layouts) and loads a dense state with
``load_full_state()``. Sharded parameters carry a :class:`TesseractShardSpec`.

Example:
    >>> groups = new_groups_2p5d(depth=2)  # on 8 ranks  # doctest: +SKIP
    >>> fc = Linear2p5D(256, 1024, groups=groups)  # weight (128, 512)  # doctest: +SKIP
    >>> y = fc(split_tensor_2p5d(x, groups))  # (16, 256) -> (4, 512)  # doctest: +SKIP
"""

from kolossos.nn.layer.parallel_2p5d._comm import (
    gather_tensor_2p5d,
    reduce_by_batch_2p5d,
    split_batch_2p5d,
    split_tensor_2p5d,
)
from kolossos.nn.layer.parallel_2p5d.dropout import Dropout2p5D
from kolossos.nn.layer.parallel_2p5d.embedding import (
    Embedding2p5D,
    PatchEmbedding2p5D,
    VocabParallelEmbedding2p5D,
)
from kolossos.nn.layer.parallel_2p5d.groups import (
    Groups2p5D,
    divide,
    new_groups_2p5d,
    tesseract_dim,
)
from kolossos.nn.layer.parallel_2p5d.layernorm import LayerNorm2p5D
from kolossos.nn.layer.parallel_2p5d.linear import (
    Classifier2p5D,
    Linear2p5D,
    VocabParallelClassifier2p5D,
)
from kolossos.nn.layer.parallel_2p5d.loss import (
    Accuracy2p5D,
    CrossEntropyLoss2p5D,
    VocabParallelCrossEntropyLoss2p5D,
)
from kolossos.nn.layer.parallel_2p5d.matmul import (
    summa_ab,
    summa_abt,
    summa_atb,
    tesseract_matmul,
    tesseract_matmul_nt,
)
from kolossos.nn.layer.parallel_2p5d.sharding import (
    ParallelModule2p5D,
    TesseractShardSpec,
    get_2p5d_spec,
    set_2p5d_spec,
)

__all__ = [
    "Accuracy2p5D",
    "Classifier2p5D",
    "CrossEntropyLoss2p5D",
    "Dropout2p5D",
    "Embedding2p5D",
    "Groups2p5D",
    "LayerNorm2p5D",
    "Linear2p5D",
    "ParallelModule2p5D",
    "PatchEmbedding2p5D",
    "TesseractShardSpec",
    "VocabParallelClassifier2p5D",
    "VocabParallelCrossEntropyLoss2p5D",
    "VocabParallelEmbedding2p5D",
    "divide",
    "gather_tensor_2p5d",
    "get_2p5d_spec",
    "new_groups_2p5d",
    "reduce_by_batch_2p5d",
    "set_2p5d_spec",
    "split_batch_2p5d",
    "split_tensor_2p5d",
    "summa_ab",
    "summa_abt",
    "summa_atb",
    "tesseract_dim",
    "tesseract_matmul",
    "tesseract_matmul_nt",
]
