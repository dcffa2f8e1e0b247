"""Activation checkpointing per pipeline stage (``gradient_checkpoint_config`` with
``pp_size > 1``): each virtual stage recomputes its first ``n`` blocks, ``n`` from the config
for that stage (``int(ratio * blocks of the stage)`` or ``num_ckpt_layers_per_stage[v]``, ``v``
the virtual stage in pipeline order). Without a pipeline ShardFormer applies the config to the
whole model (:func:`kolossos.shardformer.optimizations.apply_optimizations`).

With ``'all_to_all'`` / ``'ring_attn'`` sequence parallelism the attention reads the padding-mask
shard from the model's :class:`~kolossos.hybrid.sequence_parallel.SequenceParallelContext`, which
every micro-batch's forward overwrites. A block recomputed in the backward of micro-batch ``i``
may run after the forward of micro-batch ``j`` (any schedule but GPipe's last stage), so its
checkpoint captures the mask shard of its own forward and the recomputation runs with it
(``torch.utils.checkpoint``'s ``context_fn``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from kolossos.hybrid.config import HybridParallelConfig
from kolossos.hybrid.pipeline_runtime import PipelineRuntime
from kolossos.hybrid.sequence_parallel import SequenceParallelContext
from kolossos.shardformer.optimizations import (
    CHECKPOINTED_ATTR,
    checkpoint_blocks,
    disable_cache_when_checkpointing,
    num_ckpt_layers,
)
from kolossos.shardformer.pipeline import layout_of
from kolossos.shardformer.policies._common import is_class

__all__ = ["checkpoint_pipeline_stages", "checkpoint_with_own_mask"]


def checkpoint_with_own_mask(block: nn.Module, ctx: SequenceParallelContext) -> None:
    """Recompute ``block`` in backward (non-reentrant ``torch.utils.checkpoint``, RNG state
    preserved) with the padding-mask shard its forward saw (module doc). Module hooks stay
    outside the checkpoint, as :func:`~kolossos.shardformer.optimizations.checkpoint_blocks`
    keeps them."""
    checkpoint = functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=False, context_fn=ctx.checkpoint_contexts
    )
    if is_class(block, "GradientCheckpointingLayer"):  # transformers' own per-layer switch
        setattr(block, "gradient_checkpointing", True)  # noqa: B010 (module attribute)
        setattr(block, "_gradient_checkpointing_func", checkpoint)  # noqa: B010
    else:
        original = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if block.training and torch.is_grad_enabled():
                return checkpoint(original, *args, **kwargs)
            return original(*args, **kwargs)

        block.forward = forward
    setattr(block, CHECKPOINTED_ATTR, True)


def checkpoint_pipeline_stages(
    model: nn.Module, chunks: nn.ModuleList, pipeline: PipelineRuntime, config: HybridParallelConfig
) -> list[int]:
    """Checkpoint the first blocks of each of this rank's stages of ``model`` (the sharded
    whole model: the stage ``chunks`` share its blocks; their shallow-copied roots get
    transformers' no-cache flag).

    Returns:
        The indices of the checkpointed blocks.
    """
    ckpt = config.gradient_checkpoint_config
    if ckpt is None:
        return []
    blocks = model.get_submodule(layout_of(model, config.custom_policy).blocks)
    assert isinstance(blocks, nn.ModuleList)
    sm = pipeline.stage_manager
    counts = list(config.num_layers_per_stage or sm.distribute_layers(len(blocks)))
    starts = [sum(counts[:v]) for v in range(len(counts))]
    chosen: list[int] = []
    for stage in pipeline.stage_ranges(len(blocks)):
        virtual = starts.index(stage.start)
        n = num_ckpt_layers(ckpt, stage.end - stage.start, virtual, len(counts))
        chosen += range(stage.start, stage.start + n)
    ctx = SequenceParallelContext.of(model)
    if ctx is not None:  # attention-level SP: each recomputation with its own mask shard
        for i in chosen:
            checkpoint_with_own_mask(blocks[i], ctx)
    checkpoint_blocks([blocks[i] for i in chosen])  # (the blocks above are skipped)
    disable_cache_when_checkpointing(chunks)
    return chosen
