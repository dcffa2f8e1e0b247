"""Tensor-parallel plan for Hugging Face GPT-2 (``GPT2Model`` and its task models).

* Attention: the fused ``c_attn`` (q, k, v stacked in one ``Conv1D``) is split per block, so each
  rank computes its own heads of q, k and v; ``c_proj`` is row-parallel. ``num_heads``,
  ``split_size`` and ``embed_dim`` become per-rank values (``split_size`` is what the forward
  splits ``c_attn``'s output with).
* MLP: ``c_fc`` column-parallel, ``c_proj`` row-parallel.
* Vocabulary: ``wte`` is a vocabulary-parallel embedding; ``lm_head`` (tied to ``wte``) a
  vocabulary-parallel head sharing the same sharded parameter.
* Replicated: ``wpe``, the layer norms, dropouts, task heads other than ``lm_head``.
"""

from __future__ import annotations

from torch import nn

from kolossos.shardformer.policies._common import (
    config_of,
    find_base,
    head_paths,
    is_class,
    join,
)
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

__all__ = ["GPT2_CLASSES", "GPT2Policy"]

GPT2_CLASSES = (
    "GPT2Model",
    "GPT2LMHeadModel",
    "GPT2ForSequenceClassification",
    "GPT2ForTokenClassification",
)
"""GPT-2 classes the plan supports."""


def gpt2_block_plan(hidden: int, heads: int) -> BlockPlan:
    """The plan of one ``GPT2Block``."""
    return BlockPlan(
        layers=(
            ParallelLayer(path="attn.c_attn", style="fused_column", fused_sections=(hidden,) * 3),
            ParallelLayer(path="attn.c_proj", style="row"),
            ParallelLayer(path="mlp.c_fc", style="column"),
            ParallelLayer(path="mlp.c_proj", style="row"),
        ),
        regions=(TPRegion(path="attn"), TPRegion(path="mlp")),
        attributes=(
            LocalAttribute(path="attn.num_heads", full=heads),
            LocalAttribute(path="attn.split_size", full=hidden),
            LocalAttribute(path="attn.embed_dim", full=hidden),
        ),
        sequence_norms=("ln_1", "ln_2"),
        parallel_rng=("attn",),
        replicated_rng=("attn.resid_dropout",),
    )


class GPT2Policy(Policy):
    """Plan for ``GPT2Model``, ``GPT2LMHeadModel``, ``GPT2ForSequenceClassification`` and
    ``GPT2ForTokenClassification``."""

    def plan(self, model: nn.Module) -> ModelPlan:
        """The GPT-2 plan for ``model``.

        Raises:
            NotImplementedError: cross-attention (``add_cross_attention``) is configured.
        """
        base, prefix = find_base(model, "GPT2Model", "transformer")
        config = config_of(base)
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError(
                "GPT2 with add_cross_attention=True: the plan does not shard the cross-attention "
                "blocks; pass a custom policy that covers 'crossattention' (docs/shardformer.md)."
            )
        hidden, heads = config.hidden_size, config.num_attention_heads
        inner = config.n_inner if config.n_inner is not None else 4 * hidden
        blocks = prefix + "h"
        layers = [ParallelLayer(path=prefix + "wte", style="vocab_embedding")]
        is_lm = is_class(model, "GPT2LMHeadModel")
        if is_lm:
            layers.append(ParallelLayer(path="lm_head", style="lm_head"))
        return ModelPlan(
            family="gpt2",
            layout=StageLayout(
                embeddings=join(prefix, "wte", "wpe", "drop"),
                blocks=blocks,
                final=(prefix + "ln_f", *head_paths(model, ("lm_head", "score", "classifier"))),
                tied=((prefix + "wte.weight", "lm_head.weight"),) if is_lm else (),
            ),
            block=gpt2_block_plan(hidden, heads),
            layers=tuple(layers),
            divisible=(
                Divisible(name="num_attention_heads", value=heads),
                Divisible(name="n_inner (MLP width)", value=inner),
            ),
            sequence=SequenceBoundary(gather_after=prefix + "ln_f", norms=(prefix + "ln_f",)),
            causal_lm_loss=is_lm,
            notes=(
                f"replicated: {prefix}wpe, layer norms, task heads other than lm_head",
                f"sequence parallelism: split at the input of {blocks}.0, gathered after "
                f"{prefix}ln_f",
            ),
        )
