"""Activation checkpointing per pipeline stage (``gradient_checkpoint_config`` with
``pp_size > 1``): each virtual stage recomputes its first ``n`` blocks, ``n`` from the config
for that stage (``int(ratio * blocks of the stage)`` or ``num_ckpt_layers_per_stage[v]``, ``v``
the virtual stage in pipeline order). Without a pipeline ShardFormer applies the config to the
whole model (:func:`kolossos.shardformer.optimizations.apply_optimizations`).
"""

from __future__ import annotations

from torch import nn

from kolossos.hybrid.config import HybridParallelConfig
from kolossos.hybrid.pipeline_runtime import PipelineRuntime
from kolossos.shardformer.optimizations import (
    checkpoint_blocks,
    disable_cache_when_checkpointing,
    num_ckpt_layers,
)
from kolossos.shardformer.pipeline import layout_of

__all__ = ["checkpoint_pipeline_stages"]


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
    checkpoint_blocks([blocks[i] for i in chosen])
    disable_cache_when_checkpointing(chunks)
    return chosen
