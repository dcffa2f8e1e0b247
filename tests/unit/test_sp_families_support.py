"""Which models attention-level sequence parallelism covers (kolossos.hybrid.sp_families), and
the clear refusals for the rest; no process group needed."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from kolossos.hybrid.sp_families import model_support
from kolossos.shardformer.policies.auto_policy import get_autopolicy


def _tiny(name: str, **extra: Any) -> nn.Module:
    tf = pytest.importorskip("transformers")
    sizes = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32)  # fmt: skip
    if name.startswith("OPT"):
        config = tf.OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                              num_attention_heads=2, word_embed_proj_dim=16, **extra)  # fmt: skip
    elif name.startswith("ViT"):
        config = tf.ViTConfig(image_size=4, patch_size=2, **sizes, **extra)
    else:
        config = tf.BertConfig(vocab_size=64, **sizes, **extra)
    return getattr(tf, name)(config)  # type: ignore[no-any-return]


def support(model: nn.Module) -> Any:
    return model_support(model, get_autopolicy(model).plan(model), "all_to_all")


@pytest.mark.parametrize(
    ("name", "attention", "lm", "head"),
    [
        ("OPTForCausalLM", "self_attn", True, None),
        ("OPTModel", "self_attn", None, None),
        ("OPTForSequenceClassification", "self_attn", None, "score"),
        ("ViTModel", "attention", None, "pooler"),
        ("ViTForImageClassification", "attention", None, "classifier"),
        ("BertForSequenceClassification", "attention.self", None, "bert.pooler"),
        ("BertForMaskedLM", "attention.self", False, None),
    ],
)
def test_covered_models(name: str, attention: str, lm: bool | None, head: str | None) -> None:
    got = support(_tiny(name))
    assert (got.attention_path, got.causal_lm) == (attention, lm)
    assert (got.head.path if got.head else None) == head
    assert got.image == name.startswith("ViT")


def test_refusals_name_the_fix() -> None:
    with pytest.raises(NotImplementedError, match=r"BertForTokenClassification.*'split_gather'"):
        support(_tiny("BertForTokenClassification"))
    with pytest.raises(NotImplementedError, match=r"layerdrop > 0.*config.layerdrop=0"):
        support(_tiny("OPTForCausalLM", layerdrop=0.1))
