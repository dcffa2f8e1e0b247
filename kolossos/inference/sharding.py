"""Which causal LMs the inference engine runs, and how they are split over a tensor-parallel group.

Sharding reuses the training plans of :mod:`kolossos.shardformer` unchanged: attention heads are
split over the group, so each rank's key/value cache holds only its own heads (the KV cache is
sharded by head without any cache-specific code). The plans run with ``parallel_output=False``:
the vocabulary-parallel LM head gathers its logits to the full vocabulary (padding stripped), so
every rank sees the same full logits and picks the same token.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from kolossos.shardformer import ShardConfig, ShardFormer
from kolossos.shardformer.policies import get_autopolicy

__all__ = [
    "CAUSAL_LM_CLASSES",
    "check_causal_lm",
    "context_length",
    "hf_config",
    "shard_causal_lm",
]

CAUSAL_LM_CLASSES = ("GPT2LMHeadModel", "OPTForCausalLM", "LlamaForCausalLM")
"""The transformers classes generation is implemented and tested for."""


def check_causal_lm(model: nn.Module) -> str:
    """The class name of ``model`` if it is a supported transformers causal LM.

    Raises:
        ValueError: any other model, naming the supported classes.
    """
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ in CAUSAL_LM_CLASSES:
            return cls.__name__
    raise ValueError(
        f"InferenceEngine does not support {type(model).__name__} "
        f"({type(model).__module__}); it generates with {', '.join(CAUSAL_LM_CLASSES)} "
        "(transformers classes, built from a config or loaded with from_pretrained). For "
        "another model call its own generate()."
    )


def hf_config(model: nn.Module) -> Any:
    """The transformers config of a model :func:`check_causal_lm` accepted."""
    config: Any = model.config  # every transformers model has one
    return config


def context_length(model: nn.Module) -> int:
    """The most positions the model was configured for (prompt plus generated tokens)."""
    return int(hf_config(model).max_position_embeddings)


def shard_causal_lm(model: nn.Module, tp_group: ProcessGroup) -> nn.Module:
    """Split ``model`` in place over ``tp_group`` with its built-in tensor-parallel plan.

    Every size check (heads, KV heads, MLP width divisible by the group size) runs before the
    first collective.

    Args:
        model: a supported causal LM with its full weights.
        tp_group: the ranks that share the model; all of them call this together.

    Returns:
        The same model, sharded, returning full-vocabulary logits.

    Raises:
        ValueError: a size is not divisible by the group size (the message names it).
    """
    get_autopolicy(model)  # a clear error for a model without a plan, before ShardFormer runs
    config = ShardConfig(tensor_parallel_process_group=tp_group, parallel_output=False)
    sharded, _ = ShardFormer(config).optimize(model)
    return sharded
