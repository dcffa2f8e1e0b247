"""1D (Megatron) tensor parallelism: column/row-parallel linear layers, vocabulary-parallel
embedding and LM head with a vocabulary-parallel cross-entropy, Megatron sequence parallelism,
tensor-parallel dropout, and the shard specs checkpoint IO reads.

Every layer has ``from_native_module(module, process_group, **options)``, which slices the full
weights of an existing ``nn.Linear`` / transformers ``Conv1D`` / ``nn.Embedding`` / ``nn.Dropout``,
and ``full_weight()`` to gather them back.

Example:
    >>> from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row
    >>> up = Linear1D_Col.from_native_module(mlp.fc1, group)  # doctest: +SKIP
    >>> down = Linear1D_Row.from_native_module(mlp.fc2, group)  # doctest: +SKIP
"""

from kolossos.nn.layer.parallel_1d._base import SEQ_PARALLEL_MODES, ParallelModule1D, is_conv1d
from kolossos.nn.layer.parallel_1d._comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_reduce_scatter_grad,
    reduce_from_tp,
    reduce_scatter_seq_gather_grad,
    split_to_tp,
)
from kolossos.nn.layer.parallel_1d.cross_entropy import vocab_parallel_cross_entropy
from kolossos.nn.layer.parallel_1d.dropout import (
    Dropout1D,
    DropoutForParallelInput,
    DropoutForReplicatedInput,
)
from kolossos.nn.layer.parallel_1d.embedding import Embedding1D, VocabParallelEmbedding1D
from kolossos.nn.layer.parallel_1d.fused_linear import FusedLinear1D_Col
from kolossos.nn.layer.parallel_1d.grad_sync import (
    all_reduce_sequence_parallel_grads,
    sequence_parallel_params,
)
from kolossos.nn.layer.parallel_1d.linear import Linear1D_Col, Linear1D_Row
from kolossos.nn.layer.parallel_1d.lm_head import VocabParallelLMHead1D
from kolossos.nn.layer.parallel_1d.random import (
    TPRNGTracker,
    default_rng_in_sync,
    ensure_tp_rng_states,
    get_tp_rng_tracker,
)
from kolossos.nn.layer.parallel_1d.sharding import (
    TPShardSpec,
    gather_tp_full,
    get_tp_spec,
    is_sequence_parallel,
    mark_sequence_parallel,
    set_tp_spec,
    slice_tp_shard,
    tp_shard_pieces,
)

__all__ = [
    "SEQ_PARALLEL_MODES",
    "Dropout1D",
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "Embedding1D",
    "FusedLinear1D_Col",
    "Linear1D_Col",
    "Linear1D_Row",
    "ParallelModule1D",
    "TPRNGTracker",
    "TPShardSpec",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "all_reduce_sequence_parallel_grads",
    "copy_to_tp",
    "default_rng_in_sync",
    "ensure_tp_rng_states",
    "gather_from_tp",
    "gather_seq_reduce_scatter_grad",
    "gather_tp_full",
    "get_tp_rng_tracker",
    "get_tp_spec",
    "is_conv1d",
    "is_sequence_parallel",
    "mark_sequence_parallel",
    "reduce_from_tp",
    "reduce_scatter_seq_gather_grad",
    "sequence_parallel_params",
    "set_tp_spec",
    "slice_tp_shard",
    "split_to_tp",
    "tp_shard_pieces",
    "vocab_parallel_cross_entropy",
]
