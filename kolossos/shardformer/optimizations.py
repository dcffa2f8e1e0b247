"""ShardFormer's optimisations, applied to a model before it is sharded: SDPA attention
(``enable_flash_attention``), fused norms (``enable_fused_normalization``), fused dropout + add
and tanh-GELU (``enable_jit_fused``), activation checkpointing of the first blocks
(``gradient_checkpoint_config``), and without tensor parallelism the LM head's aligned products
(:func:`align_plan_heads`). Parameters and their names are unchanged by all of them.

See ``docs/tensor_parallel.md`` ("ShardFormer optimisations") for what each does per family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from kolossos.shardformer.grad_ckpt_config import (
    GradientCheckpointConfig,
    PipelineGradientCheckpointConfig,
)
from kolossos.shardformer.layer.aligned_head import align_lm_head
from kolossos.shardformer.layer.normalization import FusedRMSNorm
from kolossos.shardformer.modeling.jit_fused import apply_jit_fused
from kolossos.shardformer.policies._common import is_class
from kolossos.shardformer.policies.base_policy import ModelPlan
from kolossos.shardformer.shard_config import ShardConfig
from kolossos.shardformer.validate import block_list

__all__ = [
    "CHECKPOINTED_ATTR",
    "align_plan_heads",
    "apply_optimizations",
    "checkpoint_blocks",
    "disable_cache_when_checkpointing",
    "fuse_norms",
    "num_ckpt_layers",
    "use_sdpa_attention",
]

CHECKPOINTED_ATTR = "_kolossos_checkpointed"
"""Set (``True``) on every block whose activations are recomputed in backward."""


def use_sdpa_attention(model: nn.Module) -> None:
    """Route the model's attention through ``torch.nn.functional.scaled_dot_product_attention``
    (transformers' ``"sdpa"`` implementation; PyTorch picks the fastest kernel the inputs
    allow: flash / memory-efficient / cuDNN on CUDA, the CPU flash kernel or the math kernel on
    the CPU).

    Raises:
        NotImplementedError: the model has no transformers config to select it with.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise NotImplementedError(
            f"enable_flash_attention=True: {type(model).__name__} has no transformers config "
            "with an attention implementation to switch to 'sdpa'; leave it False."
        )
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter("sdpa")
    else:  # older transformers: the modules read the shared config at every forward
        config._attn_implementation = "sdpa"


def _is_hf_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and hasattr(module, "variance_epsilon")
    )


def fuse_norms(model: nn.Module) -> int:
    """Replace every Hugging Face RMSNorm by :class:`~kolossos.shardformer.layer.TorchRMSNorm`
    (``torch.nn.functional.rms_norm``, sharing the weight). ``nn.LayerNorm`` is kept: it already
    runs the single fused ``native_layer_norm`` kernel.

    Returns:
        The number of norms replaced.
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        if not name or not _is_hf_rms_norm(module):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FusedRMSNorm.from_native_module(module))
        replaced += 1
    return replaced


def _checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant activation checkpointing (RNG states preserved, so dropout replays)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _checkpoint_module(block: nn.Module) -> None:
    if is_class(block, "GradientCheckpointingLayer"):
        # transformers' own per-layer switch: it also drops the KV cache while recomputing
        setattr(block, "gradient_checkpointing", True)  # noqa: B010 (module attribute)
        setattr(block, "_gradient_checkpointing_func", _checkpoint)  # noqa: B010
        return
    original = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return _checkpoint(original, *args, **kwargs)
        return original(*args, **kwargs)

    block.forward = forward  # hooks stay outside the checkpoint


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> None:
    """Recompute the activations of ``blocks`` in backward (training mode, grad enabled)
    instead of keeping them (``torch.utils.checkpoint``, non-reentrant). Module hooks (the
    pipeline's injection, the TP regions' entries inside a block re-run) behave as without."""
    for block in blocks:
        if not getattr(block, CHECKPOINTED_ATTR, False):
            _checkpoint_module(block)
            setattr(block, CHECKPOINTED_ATTR, True)


def disable_cache_when_checkpointing(root: nn.Module) -> None:
    """Set transformers' model-level ``gradient_checkpointing`` flag on ``root`` and its
    sub-models (not the layers): in training they then pass no KV cache to the blocks, which a
    recomputed block would otherwise update twice."""
    for module in root.modules():
        flag = getattr(module, "gradient_checkpointing", None)
        if isinstance(flag, bool) and not is_class(module, "GradientCheckpointingLayer"):
            setattr(module, "gradient_checkpointing", True)  # noqa: B010


def num_ckpt_layers(
    config: GradientCheckpointConfig, num_layers: int, stage: int = 0, num_stages: int = 1
) -> int:
    """How many of a stage's ``num_layers`` blocks ``config`` checkpoints (``stage``: the
    virtual stage's index in pipeline order, of ``num_stages``)."""
    if isinstance(config, PipelineGradientCheckpointConfig):
        return config.get_num_ckpt_layers(stage, num_stages, num_layers)
    return config.get_num_ckpt_layers(num_layers)


def align_plan_heads(model: nn.Module, plan: ModelPlan, multiple: int) -> int:
    """Without tensor parallelism: make the plan's LM heads :class:`AlignedLMHead` (their CUDA
    products over the vocabulary padded to ``multiple``; parameters unchanged). Returns how
    many were changed."""
    heads = [model.get_submodule(layer.path) for layer in plan.layers if layer.style == "lm_head"]
    return sum(align_lm_head(head, multiple) for head in heads)


def apply_optimizations(model: nn.Module, plan: ModelPlan, config: ShardConfig) -> None:
    """Apply the optimisations ``config`` asks for to ``model`` (in place, before sharding).

    Raises:
        NotImplementedError: an optimisation the model's family cannot take (named).
    """
    if config.enable_flash_attention:
        use_sdpa_attention(model)
    if config.enable_fused_normalization:
        fuse_norms(model)
    if config.enable_jit_fused:
        apply_jit_fused(block_list(model, plan))
    ckpt = config.gradient_checkpoint_config
    if ckpt is not None:
        blocks = block_list(model, plan)
        checkpoint_blocks(list(blocks)[: num_ckpt_layers(ckpt, len(blocks))])
        disable_cache_when_checkpointing(model)
