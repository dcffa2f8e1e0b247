"""The graph executor's pieces without a process group: which dimension is the batch and which
the features in a traced GPT-2, the local shapes a rank's graph is rewritten to, the errors for
plans it cannot run, and the ILP's tied-weight and broadcast-tensor rules."""

from __future__ import annotations

import pytest
import torch

from kolossos.auto_parallel import CostModel
from kolossos.auto_parallel.apply_graph import export_model
from kolossos.auto_parallel.graph_rewrite import GraphRewriter
from kolossos.auto_parallel.module_graph import build_module_graph, trace_operators
from kolossos.auto_parallel.shard_dims import base_name, view_dim
from kolossos.auto_parallel.sharding_graph import edge_cost, evaluate
from kolossos.auto_parallel.strategies import UnsupportedOperatorError
from kolossos.auto_parallel.transformer_plan import search_free
from kolossos.auto_parallel.transformer_strategies import megatron_assignment, transformer_graph

BATCH, SEQ = 8, 24
COST = {"flops_per_s": 5e9, "alpha": 1e-6, "beta": 1e-8}


def _gpt2(heads: int = 4) -> torch.nn.Module:
    import transformers as tf

    hidden = 8 * heads
    config = tf.GPT2Config(n_layer=1, n_embd=hidden, n_head=heads, vocab_size=128,
                           n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


def _samples() -> dict[str, torch.Tensor]:
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _rewriter(model: torch.nn.Module, names: str) -> GraphRewriter:
    cost = CostModel(world_size=2, **COST)
    program, traced = export_model(model, _samples())
    groups = build_module_graph(traced, model, ["input_ids", "labels"])
    graph = transformer_graph(groups, cost)
    wanted = megatron_assignment(groups) if names == "megatron" else [{"B", "dp"}] * len(groups)
    picks = [next(i for i, s in enumerate(n.strategies) if s.name in w)
             for n, w in zip(graph.nodes, wanted, strict=True)]  # fmt: skip
    plan = evaluate(graph, picks, cost)
    strategies = dict(zip(plan.nodes, plan.strategies, strict=True))
    return GraphRewriter(program, groups, strategies, model, 2, 0, None)  # type: ignore[arg-type]


def test_view_dim_follows_the_element_order() -> None:
    assert view_dim((8, 24, 32), (8, 24, 4, 8), 2) == 2  # hidden -> heads (the outer factor)
    assert view_dim((192, 32), (8, 24, 32), 0) == 0  # flattened rows -> batch
    assert view_dim((8, 24, 4, 8), (8, 24, 32), 2) == 2  # heads -> hidden
    assert view_dim((8, 24, 32), (8, 768), 1) == 1  # seq blocks stay contiguous blocks
    assert view_dim((8, 24, 32), (8, 768), 2) is None  # features become an inner factor


def test_gpt2_batch_and_feature_dimensions() -> None:
    rewriter = _rewriter(_gpt2(), "dp")
    nodes = rewriter.nodes
    sdpa = next(n for n in nodes.values() if base_name(n) == "scaled_dot_product_attention")
    q = sdpa.args[0]
    assert isinstance(q, torch.fx.Node)
    # [batch, heads, seq, head_dim]: the batch on 0; the features (heads) on 1, reached from
    # c_attn's [rows, 3 * hidden] through view, split, view and transpose
    assert rewriter.dims["B"][q.name] == 0 and rewriter.dims["F"][q.name] == 1
    addmms = [n for n in nodes.values() if base_name(n) == "addmm"]
    assert all(rewriter.dims["F"][n.name] == 1 and rewriter.dims["B"][n.name] == 0
               for n in addmms)  # fmt: skip
    loss = next(n for n in nodes.values() if base_name(n) == "cross_entropy_loss")
    assert rewriter.dims["B"][loss.name] is None  # a scalar


def test_megatron_graph_has_local_shapes() -> None:
    rewriter = _rewriter(_gpt2(), "megatron")
    graph, params, specs, _ = rewriter.rewrite()
    # c_attn's weight [32, 96] is stored as this rank's 16 columns of each of q, k and v
    assert specs["transformer.h.0.attn.c_attn.weight"].dim == 1
    assert specs["transformer.h.0.attn.c_attn.weight"].chunks == 3
    attr = specs["transformer.h.0.attn.c_attn.weight"].attr
    assert tuple(params[attr].shape) == (32, 48)
    # the tied wte / lm_head: rows split once (vocabulary-parallel embedding, column head)
    assert specs["transformer.wte.weight"].dim == 0
    assert tuple(params[specs["transformer.wte.weight"].attr].shape) == (64, 32)
    splits = [n for n in graph.nodes if n.op == "call_function" and base_name(n) == "split"]
    assert [n.args[1] for n in splits] == [16]  # q, k, v of 2 of the 4 heads each
    targets = {getattr(n.target, "__name__", "") for n in graph.nodes}
    assert {"row_matmul", "vocab_embedding", "vocab_cross_entropy", "relayout"} <= targets


def test_heads_not_divisible_name_the_node() -> None:
    rewriter = _rewriter(_gpt2(heads=3), "megatron")
    with pytest.raises(UnsupportedOperatorError, match=r"node '.*' .*not divisible by the 2"):
        rewriter.rewrite()


def test_ilp_keeps_a_tied_weight_one_way() -> None:
    groups = trace_operators(_gpt2(), _samples())
    cost = CostModel(world_size=2, **COST)
    graph = transformer_graph(groups, cost)
    head = graph["lm_head"]
    assert head.tied_to == "transformer.wte"
    for budget in (None, 0.9 * evaluate(graph, [0] * len(graph.nodes), cost).memory):
        plan = search_free(groups, cost, budget)
        chosen = dict(zip(plan.nodes, plan.strategies, strict=True))
        pairs = {"dp": "dp", "rep": "rep", "vocab": "col"}
        assert chosen["lm_head"].name == pairs[chosen["transformer.wte"].name]


def test_broadcast_tensor_pays_its_gradient_sum() -> None:
    cost = CostModel(world_size=2, **COST)
    sliced, _ = edge_cost("R", "B", 4096.0, cost, into_sink=False)
    summed, _ = edge_cost("R", "B", 4096.0, cost, into_sink=False, no_batch=True)
    assert summed == pytest.approx(cost.all_reduce(4096.0)) and summed != sliced
    assert edge_cost("B", "R", 4096.0, cost, into_sink=False, no_batch=True)[0] == 0.0
    groups = trace_operators(_gpt2(), _samples())
    assert transformer_graph(groups, cost)["transformer.wpe"].no_batch


def test_sequence_layout_offered_where_the_sequence_stays_a_dimension() -> None:
    import transformers as tf

    cost = CostModel(world_size=2, **COST)
    gpt2 = {g.name: g for g in trace_operators(_gpt2(), _samples())}
    # Conv1D flattens batch and sequence into rows: its layer norms' views and matmuls lose
    # the sequence axis; the residual adds keep it
    assert not gpt2["transformer.h.0.ln_1"].seq_ok
    assert not gpt2["transformer.h.0.attn.c_attn"].seq_ok
    assert gpt2["transformer.h.0.add"].seq_ok
    graph = transformer_graph(list(gpt2.values()), cost)
    assert "Q" in {s.name for s in graph["transformer.h.0.add"].strategies}
    assert "sp" not in {s.name for s in graph["transformer.h.0.mlp.c_fc"].strategies}
    config = tf.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                            use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    llama = trace_operators(tf.LlamaForCausalLM(config), _samples())
    graph = transformer_graph(llama, cost)
    names = {n.name: {s.name for s in n.strategies} for n in graph.nodes}
    assert "sp" in names["model.layers.0.mlp.up_proj"]
    assert "Q" in names["model.layers.0.input_layernorm"]
    attention = graph["model.layers.0.self_attn.attention"]
    q = next(s for s in attention.strategies if s.name == "Q")  # over all-gathered keys
    b = next(s for s in attention.strategies if s.name == "B")
    assert q.compute_s == b.compute_s and q.comm_s > b.comm_s == 0.0
    gpt2_graph = transformer_graph(list(gpt2.values()), cost)
    assert "Q" not in {s.name for s in gpt2_graph["transformer.h.0.attn.attention"].strategies}
    sp = next(s for s in graph["model.layers.0.mlp.up_proj"].strategies if s.name == "sp")
    dp = next(s for s in graph["model.layers.0.mlp.up_proj"].strategies if s.name == "dp")
    assert (sp.compute_s, sp.comm_s, sp.memory) == (dp.compute_s, dp.comm_s, dp.memory)
