"""Tensor-parallel plan for Hugging Face LLaMA (``LlamaModel`` and its task models).

* Attention: ``q_proj``, ``k_proj``, ``v_proj`` column-parallel, ``o_proj`` row-parallel. With
  grouped-query attention each rank keeps ``num_attention_heads / tp`` query heads and
  ``num_key_value_heads / tp`` KV heads, so both must be divisible by the tensor-parallel size and
  the query-to-KV grouping (``num_key_value_groups``) is unchanged. The forward reshapes with
  ``-1`` heads and ``head_dim``, so no head-count attribute needs changing.
* MLP: ``gate_proj`` and ``up_proj`` column-parallel, ``down_proj`` row-parallel.
* Vocabulary: ``embed_tokens`` vocabulary-parallel; ``lm_head`` a vocabulary-parallel head
  (sharing ``embed_tokens``' sharded weight when ``tie_word_embeddings``).
* Replicated: the RMS norms and the rotary embedding.
"""

from __future__ import annotations

from torch import nn

from kolossos.shardformer.policies._common import config_of, find_base, head_paths, is_class
from kolossos.shardformer.policies.base_policy import (
    BlockPlan,
    Divisible,
    ModelPlan,
    ParallelLayer,
    Policy,
    SequenceBoundary,
    StageLayout,
    TPRegion,
)

__all__ = ["LLAMA_CLASSES", "LlamaPolicy"]

LLAMA_CLASSES = ("LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification")
"""LLaMA classes the plan supports."""

LLAMA_BLOCK = BlockPlan(
    layers=(
        ParallelLayer(path="self_attn.q_proj", style="column"),
        ParallelLayer(path="self_attn.k_proj", style="column"),
        ParallelLayer(path="self_attn.v_proj", style="column"),
        ParallelLayer(path="self_attn.o_proj", style="row"),
        ParallelLayer(path="mlp.gate_proj", style="column"),
        ParallelLayer(path="mlp.up_proj", style="column"),
        ParallelLayer(path="mlp.down_proj", style="row"),
    ),
    regions=(TPRegion(path="self_attn"), TPRegion(path="mlp", arg="x")),
    sequence_norms=("input_layernorm", "post_attention_layernorm"),
    parallel_rng=("self_attn",),
)
"""The plan of one ``LlamaDecoderLayer``."""


class LlamaPolicy(Policy):
    """Plan for ``LlamaModel``, ``LlamaForCausalLM`` and ``LlamaForSequenceClassification``."""

    def plan(self, model: nn.Module) -> ModelPlan:
        """The LLaMA plan for ``model``."""
        base, prefix = find_base(model, "LlamaModel", "model")
        config = config_of(base)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        is_lm = is_class(model, "LlamaForCausalLM")
        layers = [ParallelLayer(path=prefix + "embed_tokens", style="vocab_embedding")]
        if is_lm:
            layers.append(ParallelLayer(path="lm_head", style="lm_head"))
        return ModelPlan(
            family="llama",
            layout=StageLayout(
                embeddings=(prefix + "embed_tokens", prefix + "rotary_emb"),
                blocks=prefix + "layers",
                final=(prefix + "norm", *head_paths(model, ("lm_head", "score"))),
                tied=((prefix + "embed_tokens.weight", "lm_head.weight"),) if is_lm else (),
            ),
            block=LLAMA_BLOCK,
            layers=tuple(layers),
            divisible=(
                Divisible(name="num_attention_heads", value=heads),
                Divisible(name="num_key_value_heads", value=kv_heads),
                Divisible(name="intermediate_size", value=config.intermediate_size),
            ),
            sequence=SequenceBoundary(gather_after=prefix + "norm", norms=(prefix + "norm",)),
            causal_lm_loss=is_lm,
            notes=(
                "replicated: RMS norms, rotary embedding, score head",
                f"GQA: {heads} query heads and {kv_heads} KV heads split over the group",
            ),
        )
