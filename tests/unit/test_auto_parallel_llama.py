"""The operator graph and Megatron plan of a tiny Hugging Face LLaMA (no process group).

2 layers, hidden 32, 4 heads (4 key/value heads), MLP 64, vocabulary 128, batch 8 x 24.
Operators come from module types: ``LlamaRMSNorm`` is a normalisation (replicated under
Megatron), the rotary embedding an elementwise operator on ``q_proj``/``k_proj``, the gated MLP's
``act_fn(gate_proj) * up_proj`` a two-input operator; the Megatron plan shards
``q/k/v/gate/up_proj`` by columns, ``o/down_proj`` by rows, the rotary, attention, SiLU and the
gate product by heads/features, and the blocks ``model.layers.*`` are found for checkpointing.
"""

from __future__ import annotations

import pytest
import torch

from kolossos.auto_parallel import CostModel
from kolossos.auto_parallel.module_graph import OperatorGroup, trace_operators
from kolossos.auto_parallel.transformer_checkpoint import repeated_blocks
from kolossos.auto_parallel.transformer_plan import family_plan, search_transformer_plan

BATCH, SEQ = 8, 24


@pytest.fixture(scope="module")
def groups() -> list[OperatorGroup]:
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            max_position_embeddings=64, tie_word_embeddings=False,
                            use_cache=False, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0)  # fmt: skip
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return trace_operators(tf.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids})


def test_operator_graph(groups) -> None:
    by_name = {g.name: g for g in groups}
    block = "model.layers.0"
    assert by_name[f"{block}.input_layernorm"].kind == "layernorm"
    assert by_name[f"{block}.input_layernorm"].module_type == "LlamaRMSNorm"
    rotary = by_name[f"{block}.self_attn"]
    assert rotary.kind == "elementwise"
    assert rotary.inputs == [f"{block}.self_attn.q_proj", f"{block}.self_attn.k_proj"]
    assert by_name[f"{block}.self_attn.attention"].inputs == [
        f"{block}.self_attn",
        f"{block}.self_attn.v_proj",
    ]
    assert by_name[f"{block}.self_attn.o_proj"].inputs == [f"{block}.self_attn.attention"]
    assert by_name[f"{block}.mlp.add"].inputs == [f"{block}.mlp.act_fn", f"{block}.mlp.up_proj"]
    assert sum(g.kind == "layernorm" for g in groups) == 5  # 2 per block + the final norm
    assert repeated_blocks(groups)[0] == ["model.layers.0", "model.layers.1"]


def test_megatron_plan(groups) -> None:
    cost = CostModel(world_size=2, flops_per_s=5e9, alpha=1e-6, beta=1e-8)
    plan = family_plan("megatron", groups, cost)
    chosen = dict(zip(plan.nodes, plan.names, strict=True))
    block = "model.layers.1"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):  # fmt: skip
        assert chosen[f"{block}.{name}"] == "col", name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert chosen[f"{block}.{name}"] == "row", name
    for name in ("self_attn", "self_attn.attention", "mlp.act_fn", "mlp.add"):
        assert chosen[f"{block}.{name}"] == "F", name
    for name in ("input_layernorm", "post_attention_layernorm", "add", "add#1"):
        assert chosen[f"{block}.{name}"] == "R", name
    assert (chosen["model.embed_tokens"], chosen["lm_head"], chosen["loss"]) == (
        "vocab",
        "col",
        "F",
    )
    assert plan.reshard_s == (0.0,) * len(plan.nodes)  # no layout change between operators
    dp = family_plan("dp", groups, cost)
    assert plan.memory < dp.memory
    assert search_transformer_plan(groups, cost, (plan.memory + dp.memory) / 2)[0] == "megatron"
