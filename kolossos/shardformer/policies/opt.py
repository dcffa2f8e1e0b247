"""Tensor-parallel plan for Hugging Face OPT (``OPTModel`` and its task models).

* Attention: ``q_proj``, ``k_proj``, ``v_proj`` column-parallel, ``out_proj`` row-parallel;
  ``num_heads`` (read by the forward's reshapes) and ``embed_dim`` become per-rank values.
* MLP: ``fc1`` column-parallel, ``fc2`` row-parallel. They sit directly in the decoder layer and
  see flattened ``(tokens, hidden)`` activations, so under sequence parallelism the token
  dimension is 0.
* Vocabulary: ``embed_tokens`` vocabulary-parallel; ``lm_head`` (tied to it) a
  vocabulary-parallel head sharing the sharded weight.
* Replicated: learned position embeddings, ``project_in``/``project_out``, the LayerNorms.
"""

from __future__ import annotations

from torch import nn

from kolossos.shardformer.policies._common import (
    block_count,
    config_of,
    find_base,
    head_paths,
    is_class,
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

__all__ = ["OPT_CLASSES", "OPTPolicy"]

OPT_CLASSES = ("OPTModel", "OPTForCausalLM", "OPTForSequenceClassification")
"""OPT classes the plan supports."""


def opt_block_plan(hidden: int, heads: int) -> BlockPlan:
    """The plan of one ``OPTDecoderLayer``."""
    return BlockPlan(
        layers=(
            ParallelLayer(path="self_attn.q_proj", style="column"),
            ParallelLayer(path="self_attn.k_proj", style="column"),
            ParallelLayer(path="self_attn.v_proj", style="column"),
            ParallelLayer(path="self_attn.out_proj", style="row"),
            ParallelLayer(path="fc1", style="column"),
            ParallelLayer(path="fc2", style="row", seq_dim=0),
        ),
        regions=(TPRegion(path="self_attn"), TPRegion(path="fc1", arg="input", seq_dim=0)),
        attributes=(
            LocalAttribute(path="self_attn.num_heads", full=heads),
            LocalAttribute(path="self_attn.embed_dim", full=hidden),
        ),
        sequence_norms=("self_attn_layer_norm", "final_layer_norm"),
        parallel_rng=("self_attn",),
    )


class OPTPolicy(Policy):
    """Plan for ``OPTModel``, ``OPTForCausalLM`` and ``OPTForSequenceClassification``."""

    def plan(self, model: nn.Module) -> ModelPlan:
        """The OPT plan for ``model``."""
        base, prefix = find_base(model, "OPTModel", "model")
        config = config_of(base)
        hidden, heads = config.hidden_size, config.num_attention_heads
        decoder = prefix + "decoder."
        blocks = decoder + "layers"
        is_lm = is_class(model, "OPTForCausalLM")
        layers = [ParallelLayer(path=decoder + "embed_tokens", style="vocab_embedding")]
        if is_lm:
            layers.append(ParallelLayer(path="lm_head", style="lm_head"))
        embeddings = [decoder + "embed_tokens", decoder + "embed_positions"]
        final: list[str] = []
        for name, target in (("project_in", embeddings), ("final_layer_norm", final)):
            if getattr(base.decoder, name, None) is not None:
                target.append(decoder + name)
        if getattr(base.decoder, "project_out", None) is not None:
            final.append(decoder + "project_out")
        sequence = None
        notes = ["replicated: position embeddings, project_in/out, LayerNorms"]
        if getattr(config, "layerdrop", 0.0) > 0.0:
            notes.append(
                f"no sequence parallelism with layerdrop={config.layerdrop}: a skipped first or "
                "last layer would skip the split or the gather; set config.layerdrop=0"
            )
        else:
            last = f"{blocks}.{block_count(model, blocks) - 1}"
            sequence = SequenceBoundary(gather_after=last)
        return ModelPlan(
            family="opt",
            layout=StageLayout(
                embeddings=tuple(embeddings),
                blocks=blocks,
                final=(*final, *head_paths(model, ("lm_head", "score"))),
                tied=((decoder + "embed_tokens.weight", "lm_head.weight"),) if is_lm else (),
            ),
            block=opt_block_plan(hidden, heads),
            layers=tuple(layers),
            divisible=(
                Divisible(name="num_attention_heads", value=heads),
                Divisible(name="ffn_dim", value=config.ffn_dim),
            ),
            sequence=sequence,
            causal_lm_loss=is_lm,
            notes=tuple(notes),
        )
