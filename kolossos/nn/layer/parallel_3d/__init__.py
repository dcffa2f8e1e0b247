"""3D tensor parallelism (``P = q x q x q`` ranks, F0:6706-6904) over explicit process groups.

Build the groups once (:func:`build_groups_3d`, or from the legacy context in
:mod:`kolossos.legacy.nn.layer.parallel_3d`), then chain layers through ``output_groups``: a
linear layer hands its output on with the input and output roles exchanged.

Every layer builds its shards from the full tensor of the dense layer it stands for (same seed,
same full matrix, then each rank takes its block), gathers it back with ``full_state()`` under
the dense layer's names and layouts (loadable by ``nn.Linear`` / ``nn.LayerNorm`` /
``nn.Embedding``), and loads a dense state with ``load_full_state()``. Each parameter carries a
:class:`Shard3DSpec` (its splits, and how many ranks of the cube hold the same block).

Example:
    >>> groups = build_groups_3d()  # 8 ranks, q = 2  # doctest: +SKIP
    >>> fc1 = Linear3D(256, 1024, groups=groups)  # weight (128, 256)  # doctest: +SKIP
    >>> fc2 = Linear3D(1024, 256, groups=fc1.output_groups)  # weight (512, 64)  # doctest: +SKIP
    >>> y = fc2(F.gelu(fc1(split_tensor_3d(split_batch_3d(x, groups), -1, groups.output))))
    ...     # doctest: +SKIP
"""

from kolossos.nn.layer.parallel_3d._base import ParallelModule3D
from kolossos.nn.layer.parallel_3d._comm import (
    all_reduce_both,
    linear_3d,
    reduce_by_batch_3d,
    split_batch_3d,
    split_tensor_3d,
    sync_grad,
)
from kolossos.nn.layer.parallel_3d.dropout import Dropout3D
from kolossos.nn.layer.parallel_3d.embedding import (
    Embedding3D,
    PatchEmbedding3D,
    VocabParallelEmbedding3D,
)
from kolossos.nn.layer.parallel_3d.groups import (
    Groups3D,
    build_groups_3d,
    check_cube,
    cube_rank_lists,
    divide_3d,
)
from kolossos.nn.layer.parallel_3d.linear import Classifier3D, Linear3D, VocabParallelClassifier3D
from kolossos.nn.layer.parallel_3d.loss import (
    Accuracy3D,
    CrossEntropyLoss3D,
    VocabParallelCrossEntropyLoss3D,
)
from kolossos.nn.layer.parallel_3d.norm import LayerNorm3D
from kolossos.nn.layer.parallel_3d.sharding import (
    Shard3DSpec,
    gather_3d_full,
    get_3d_spec,
    set_3d_spec,
    slice_3d_shard,
)

__all__ = [
    "Accuracy3D",
    "Classifier3D",
    "CrossEntropyLoss3D",
    "Dropout3D",
    "Embedding3D",
    "Groups3D",
    "LayerNorm3D",
    "Linear3D",
    "ParallelModule3D",
    "PatchEmbedding3D",
    "Shard3DSpec",
    "VocabParallelClassifier3D",
    "VocabParallelCrossEntropyLoss3D",
    "VocabParallelEmbedding3D",
    "all_reduce_both",
    "build_groups_3d",
    "check_cube",
    "cube_rank_lists",
    "divide_3d",
    "gather_3d_full",
    "get_3d_spec",
    "linear_3d",
    "reduce_by_batch_3d",
    "set_3d_spec",
    "slice_3d_shard",
    "split_batch_3d",
    "split_tensor_3d",
    "sync_grad",
]
