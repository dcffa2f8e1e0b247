"""The GPT-2 operator DAG, its strategies and the plan search (fixed costs, no process group)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kolossos.auto_parallel import ColoTracer, CostModel, InfeasibleBudgetError
from kolossos.auto_parallel.module_graph import build_module_graph
from kolossos.auto_parallel.transformer_plan import (
    family_plan,
    format_dag_plan,
    search_free,
    search_transformer_plan,
)
from kolossos.auto_parallel.transformer_strategies import transformer_graph

BATCH, SEQ, HIDDEN, VOCAB, LAYERS = 8, 24, 32, 128, 2
# Communication-bound costs (gloo-like bandwidth, small latency): data parallelism all-reduces
# the parameters (12 H^2 per block), Megatron the activations (4 x T x H per block, T = 192).
COST = {"flops_per_s": 5e9, "alpha": 1e-6, "beta": 1e-8}


def gpt2() -> tf.GPT2LMHeadModel:
    config = tf.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB,
                           n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def groups():
    model = gpt2()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    traced = ColoTracer().trace(model, {"input_ids": ids, "labels": ids})
    return build_module_graph(traced, model, ["input_ids", "labels"]), traced, model


def test_operator_dag(groups) -> None:
    ops, traced, model = groups
    kinds = [g.kind for g in ops if g.path.startswith("transformer.h.0")]
    assert kinds == ["layernorm", "linear", "attention", "linear", "add", "layernorm", "linear",
                     "elementwise", "linear", "add"]  # fmt: skip
    by_name = {g.name: g for g in ops}
    assert by_name["transformer.h.0.attn.c_attn"].module_type == "Conv1D"
    assert by_name["transformer.h.0.add"].inputs == ["transformer.h.0.attn.c_proj",
                                                    "transformer.add"]  # fmt: skip
    assert by_name["loss"].inputs == ["lm_head", "labels"]
    # Every FLOP and every parameter byte (the tied wte/lm_head weight once) is in one operator.
    assert sum(g.flops for g in ops) == traced.total_flops
    params = sum(p.numel() * 4 for p in model.parameters())
    assert sum(g.param_bytes for g in ops) == params
    assert by_name["lm_head"].shared_bytes == VOCAB * HIDDEN * 4
    tokens = BATCH * SEQ
    assert by_name["transformer.h.0.mlp.c_fc"].flops == 2 * tokens * HIDDEN * 4 * HIDDEN
    assert not transformer_graph(ops, CostModel(world_size=2)).is_chain


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_when_memory_allows_megatron_when_short(groups, world_size: int) -> None:
    ops = groups[0]
    cost = CostModel(world_size=world_size, **COST)
    plans = {f: family_plan(f, ops, cost) for f in ("dp", "megatron", "replicated")}
    assert plans["megatron"].memory < plans["dp"].memory < plans["replicated"].memory
    family, plan = search_transformer_plan(ops, cost)
    assert family == "dp" and set(plan.names) <= {"dp", "B", "rep"}
    budget = (plans["megatron"].memory + plans["dp"].memory) / 2
    family, plan = search_transformer_plan(ops, cost, budget)
    assert family == "megatron" and plan.memory <= budget
    strategy = dict(zip(plan.nodes, plan.names, strict=True))
    for block in range(LAYERS):
        prefix = f"transformer.h.{block}"
        assert strategy[f"{prefix}.attn.c_attn"] == strategy[f"{prefix}.mlp.c_fc"] == "col"
        assert strategy[f"{prefix}.attn.c_proj"] == strategy[f"{prefix}.mlp.c_proj"] == "row"
        assert strategy[f"{prefix}.attn.attention"] == "F"
        assert strategy[f"{prefix}.ln_1"] == strategy[f"{prefix}.add"] == "R"
    assert strategy["transformer.wte"] == "vocab" and strategy["loss"] == "F"
    with pytest.raises(InfeasibleBudgetError, match="megatron"):
        search_transformer_plan(ops, cost, plans["megatron"].memory * 0.5)
    print(format_dag_plan(plan, transformer_graph(ops, cost)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_free_ilp_is_at_least_as_good_as_every_family(groups, world_size: int) -> None:
    ops = groups[0]
    cost = CostModel(world_size=world_size, **COST)
    for family in ("dp", "megatron", "replicated"):
        fixed = family_plan(family, ops, cost)
        free = search_free(ops, cost, memory_budget=fixed.memory)
        assert free.memory <= fixed.memory * (1 + 1e-9)
        assert free.step_time <= fixed.step_time * (1 + 1e-9)


def test_saved_activations_of_an_mlp() -> None:
    from torch import nn

    from kolossos.auto_parallel.saved_activations import saved_activation_bytes

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.empty(4, 16, device="meta")
    saved = saved_activation_bytes(ColoTracer(backend="export").trace(model, {"input": x}))
    # ReLU keeps its output (also the second linear's saved input); the output is returned.
    # The input and the weights are not activations; the first linear's output is not kept.
    assert saved == {"relu": 4 * 32 * 4, "linear_1": 4 * 8 * 4}


def test_replicated_memory_prediction_within_ten_percent(groups) -> None:
    from kolossos.accelerator import TensorMemoryTracker

    ops = groups[0]
    plan = family_plan("replicated", ops, CostModel(world_size=1))
    torch.manual_seed(0)
    model = gpt2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model, opt)
        tracker.reset_peak()
        step()
    error = (plan.memory - tracker.peak_bytes) / tracker.peak_bytes
    assert abs(error) < 0.10, (plan.memory, tracker.peak_bytes)


def test_two_by_two_mesh_is_leaner_and_chosen_at_four_ranks(groups) -> None:
    from kolossos.auto_parallel.module_graph import trace_operators
    from kolossos.auto_parallel.transformer_plan import hybrid_plan

    ops = groups[0]
    half = torch.zeros(BATCH // 2, SEQ, dtype=torch.long, device="meta")
    local = trace_operators(gpt2(), {"input_ids": half, "labels": half})
    cost = CostModel(world_size=4, **COST)
    dp, megatron = family_plan("dp", ops, cost), family_plan("megatron", ops, cost)
    hybrid = hybrid_plan(local, cost, 2)
    # Parameters split over 2 (not 4), activations over 2 (not 1 for the replicated residuals).
    assert hybrid.memory < megatron.memory < dp.memory
    assert hybrid.step_time < megatron.step_time
    family, plan = search_transformer_plan(ops, cost, (dp.memory + megatron.memory) / 2, {2: local})
    assert family == "dp2xtp2" and plan is not None
    assert search_transformer_plan(ops, cost, None, {2: local})[0] == "dp"
    with pytest.raises(ValueError, match="dp x tp"):
        hybrid_plan(local, cost, 4)


def test_unsupported_module_names_the_node() -> None:
    from kolossos.auto_parallel import UnsupportedOperatorError
    from kolossos.auto_parallel.module_graph import trace_operators

    class _Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.act = torch.nn.PReLU()  # a module with a parameter and no strategies

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.act(self.emb(input_ids))

    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with pytest.raises(UnsupportedOperatorError, match=r"node '.*' \(operator .*'act' \(PReLU"):
        trace_operators(_Net(), {"input_ids": ids})
