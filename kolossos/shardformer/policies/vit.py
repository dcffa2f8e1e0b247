"""Tensor-parallel plan for Hugging Face ViT (``ViTModel``, ``ViTForImageClassification``).

* Attention: ``q_proj``, ``k_proj``, ``v_proj`` column-parallel, ``o_proj`` row-parallel
  (``num_attention_heads`` becomes the per-rank value; the forward reshapes with ``-1`` heads).
* MLP: ``fc1`` column-parallel, ``fc2`` row-parallel.
* Replicated: the patch embedding, CLS token and position embeddings, every LayerNorm, the
  pooler and the classifier (tiny next to the blocks).

Sequence parallelism splits the ``num_patches + 1`` tokens, which must then be divisible by the
tensor-parallel size (checked at the first forward).
"""

from __future__ import annotations

from torch import nn

from kolossos.shardformer.policies._common import config_of, find_base, head_paths
from kolossos.shardformer.policies.base_policy import (
    BlockPlan,
    Divisible,
    LocalAttribute,
    ModelPlan,
    ParallelLayer,
    Policy,
    SequenceBoundary,
    StageLayout,
    TPRegion,
)

__all__ = ["VIT_CLASSES", "ViTPolicy"]

VIT_CLASSES = ("ViTModel", "ViTForImageClassification")
"""ViT classes the plan supports."""


def vit_block_plan(heads: int) -> BlockPlan:
    """The plan of one ``ViTLayer``."""
    return BlockPlan(
        layers=(
            ParallelLayer(path="attention.q_proj", style="column"),
            ParallelLayer(path="attention.k_proj", style="column"),
            ParallelLayer(path="attention.v_proj", style="column"),
            ParallelLayer(path="attention.o_proj", style="row"),
            ParallelLayer(path="mlp.fc1", style="column"),
            ParallelLayer(path="mlp.fc2", style="row"),
        ),
        regions=(TPRegion(path="attention"), TPRegion(path="mlp")),
        attributes=(LocalAttribute(path="attention.num_attention_heads", full=heads),),
        sequence_norms=("layernorm_before", "layernorm_after"),
        parallel_rng=("attention",),
    )


class ViTPolicy(Policy):
    """Plan for ``ViTModel`` and ``ViTForImageClassification``."""

    def plan(self, model: nn.Module) -> ModelPlan:
        """The ViT plan for ``model``."""
        base, prefix = find_base(model, "ViTModel", "vit")
        config = config_of(base)
        heads = config.num_attention_heads
        final = [prefix + "layernorm"]
        if getattr(base, "pooler", None) is not None:
            final.append(prefix + "pooler")
        return ModelPlan(
            family="vit",
            layout=StageLayout(
                embeddings=(prefix + "embeddings",),
                blocks=prefix + "layers",
                final=(*final, *head_paths(model, ("classifier",))),
            ),
            block=vit_block_plan(heads),
            divisible=(
                Divisible(name="num_attention_heads", value=heads),
                Divisible(name="intermediate_size", value=config.intermediate_size),
            ),
            sequence=SequenceBoundary(
                gather_after=prefix + "layernorm", norms=(prefix + "layernorm",)
            ),
            notes=("replicated: embeddings, LayerNorms, pooler, classifier",),
        )
