"""ShardFormer: tensor parallelism (1D, with Megatron sequence parallelism) for Hugging Face
models, driven by declarative plans.

Example:
    >>> from kolossos.shardformer import ShardConfig, ShardFormer
    >>> config = ShardConfig(tensor_parallel_process_group=tp_group)  # doctest: +SKIP
    >>> model, shared_params = ShardFormer(config).optimize(model)  # doctest: +SKIP

See docs/shardformer.md for the supported families and how to write a plan. The tensor-parallel
layers under Colossal-AI's names are in :mod:`kolossos.shardformer.layer`.
"""

from kolossos.shardformer.grad_ckpt_config import (
    GradientCheckpointConfig,
    PipelineGradientCheckpointConfig,
)
from kolossos.shardformer.loss import VocabParallelCausalLMLoss
from kolossos.shardformer.policies import (
    BlockPlan,
    Divisible,
    LocalAttribute,
    ModelPlan,
    ParallelLayer,
    Policy,
    SequenceBoundary,
    StageLayout,
    TPRegion,
    get_autopolicy,
)
from kolossos.shardformer.shard_config import ShardConfig
from kolossos.shardformer.shardformer import ShardFormer

__all__ = [
    "BlockPlan",
    "Divisible",
    "GradientCheckpointConfig",
    "LocalAttribute",
    "ModelPlan",
    "ParallelLayer",
    "PipelineGradientCheckpointConfig",
    "Policy",
    "SequenceBoundary",
    "ShardConfig",
    "ShardFormer",
    "StageLayout",
    "TPRegion",
    "VocabParallelCausalLMLoss",
    "get_autopolicy",
]
