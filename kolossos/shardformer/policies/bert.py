"""Tensor-parallel plan for Hugging Face BERT (``BertModel`` and its task models).

* Attention: ``query``, ``key``, ``value`` column-parallel inside ``attention.self`` (whose
  ``num_attention_heads`` and ``all_head_size`` become per-rank values);
  ``attention.output.dense`` row-parallel.
* MLP: ``intermediate.dense`` column-parallel, ``output.dense`` row-parallel.
* Vocabulary: ``word_embeddings`` vocabulary-parallel; the masked-LM ``decoder`` a
  vocabulary-parallel head sharing its sharded weight (and ``cls.predictions.bias`` its sharded
  bias). BERT computes its masked-LM loss inline on ``logits.view(-1, vocab_size)``, so that head
  always gathers the full logits.
* Replicated: position and token-type embeddings, every LayerNorm, the pooler and task heads.
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

__all__ = ["BERT_CLASSES", "BertPolicy"]

BERT_CLASSES = (
    "BertModel",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertForTokenClassification",
)
"""BERT classes the plan supports."""


def bert_block_plan(hidden: int, heads: int) -> BlockPlan:
    """The plan of one ``BertLayer``."""
    return BlockPlan(
        layers=(
            ParallelLayer(path="attention.self.query", style="column"),
            ParallelLayer(path="attention.self.key", style="column"),
            ParallelLayer(path="attention.self.value", style="column"),
            ParallelLayer(path="attention.output.dense", style="row"),
            ParallelLayer(path="intermediate.dense", style="column"),
            ParallelLayer(path="output.dense", style="row"),
        ),
        regions=(TPRegion(path="attention.self"), TPRegion(path="intermediate")),
        attributes=(
            LocalAttribute(path="attention.self.num_attention_heads", full=heads),
            LocalAttribute(path="attention.self.all_head_size", full=hidden),
        ),
        sequence_norms=("attention.output.LayerNorm", "output.LayerNorm"),
        parallel_rng=("attention.self",),
    )


class BertPolicy(Policy):
    """Plan for ``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification`` and
    ``BertForTokenClassification``."""

    def plan(self, model: nn.Module) -> ModelPlan:
        """The BERT plan for ``model``.

        Raises:
            NotImplementedError: a decoder with cross-attention is configured.
        """
        base, prefix = find_base(model, "BertModel", "bert")
        config = config_of(base)
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError(
                "BERT with add_cross_attention=True: the plan does not shard the cross-attention "
                "layers; pass a custom policy that covers 'crossattention' (docs/shardformer.md)."
            )
        hidden, heads = config.hidden_size, config.num_attention_heads
        blocks = prefix + "encoder.layer"
        embed = prefix + "embeddings.word_embeddings"
        layers = [ParallelLayer(path=embed, style="vocab_embedding")]
        tied: tuple[tuple[str, ...], ...] = ()
        if is_class(model, "BertForMaskedLM"):
            layers.append(ParallelLayer(path="cls.predictions.decoder", style="lm_head"))
            tied = (
                (embed + ".weight", "cls.predictions.decoder.weight"),
                ("cls.predictions.decoder.bias", "cls.predictions.bias"),
            )
        last = f"{blocks}.{block_count(model, blocks) - 1}"
        final = (prefix + "pooler",) if getattr(base, "pooler", None) is not None else ()
        return ModelPlan(
            family="bert",
            layout=StageLayout(
                embeddings=(prefix + "embeddings",),
                blocks=blocks,
                final=(*final, *head_paths(model, ("cls", "classifier"))),
                tied=tied,
            ),
            block=bert_block_plan(hidden, heads),
            layers=tuple(layers),
            divisible=(
                Divisible(name="num_attention_heads", value=heads),
                Divisible(name="intermediate_size", value=config.intermediate_size),
            ),
            sequence=SequenceBoundary(gather_after=last),
            causal_lm_loss=False,
            notes=(
                "replicated: position/token-type embeddings, LayerNorms, pooler, task heads",
                "the masked-LM head gathers full logits (BERT's loss is computed inline)",
            ),
        )
