"""The graph executor (``apply_graph_plan``) runs per-operator plans that mix data
parallelism, Megatron tensor parallelism and replication, vs single-process training.

Tiny Hugging Face GPT-2, LLaMA and BERT (2 layers, hidden 32, 4 heads, vocabulary 128, no
dropout), batch 8 x 24 tokens, fp32, Adam, 4 steps, on 2 and 4 gloo ranks. Plans, each chosen to
exercise a different part of the executor:

* ``dp`` / ``megatron``: the two families, run by the executor instead of their own runners
  (batch rows; fused ``c_attn`` split per head of q, k, v; row-parallel sums; vocabulary-
  parallel embedding and cross entropy);
* ``block_mix``: block 0 Megatron, block 1 data parallel, the token embedding replicated, the
  position embedding data parallel (whole on every rank, each rank's share of its gradient)
  added with the hidden features split, ``labels`` and the loss batch-sharded (R <-> B and
  R <-> F conversions around a tensor-parallel block);
* ``tied_mix``: the tied ``wte``/``lm_head`` weight used vocabulary-parallel by the embedding
  and data parallel by the head (stored whole, each use its part, one summed gradient), the
  position embedding data parallel read by a replicated add, the attention heads sharded
  while ``c_attn`` is replicated (R -> F slices), the MLP batch-sharded between replicated
  operators, the loss batch-sharded;
* ``seq_mix``: sequence-sharded (``Q``) wherever the operator allows it — for LLaMA every
  operator but the embedding and the loss (``sp`` linears: whole weights, each rank its part
  of the sequence; attention of this rank's queries over all-gathered keys and values); for
  GPT-2, whose ``Conv1D`` flattens batch and sequence, the residual adds and final layer norm
  (the position embedding is sliced by sequence where a sequence-sharded add reads it) — the
  rest replicated;
* ``ilp``: the ILP's own optimum at a budget below the data-parallel memory; for BERT
  (masked LM, ``BertForMaskedLM`` with its tied decoder) also at 80 % of it, where the ILP
  mixes sequence-sharded operators in.

Each trains from the same weights as a single process on the whole batch: the first step's
gathered gradients equal the reference's (Adam alone would hide a gradient off by a constant
factor), the loss (already the whole batch's on every rank) equals the reference at every
step, the gathered parameters at the end, and every parameter moved by more than 10x the
parameter tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kolossos.auto_parallel import CostModel
from kolossos.auto_parallel.apply_graph import apply_graph_plan
from kolossos.auto_parallel.module_graph import OperatorGroup, trace_operators
from kolossos.auto_parallel.sharding_graph import evaluate
from kolossos.auto_parallel.transformer_plan import family_plan, search_free
from kolossos.auto_parallel.transformer_strategies import megatron_assignment, transformer_graph
from kolossos.testing import distributed
from kolossos.testing.parity import assert_run_matches, reference_causal_lm, train_causal_lm

pytestmark = pytest.mark.dist

BATCH, SEQ, STEPS, LR = 8, 24, 4, 1e-2
TOL = 2e-5  # fp32 losses: only the order of sums changes
# Parameters after 4 Adam steps: an element whose true gradient is ~0 (GPT-2's key bias) turns
# the 1e-8 rounding of its gradient into up to ~3e-5 (the other autoparallelize tests' 5e-5).
PARAM_TOL = 5e-5
# The first step's gradients (fp32 sums in another order): relative, as BERT's query/key
# gradients are ~3e-6 at initialisation while the head's are ~3e-2.
GRAD_ATOL, GRAD_RTOL = 1e-8, 1e-3
COST = {"flops_per_s": 5e9, "alpha": 1e-6, "beta": 1e-8}


def _model(kind: str) -> torch.nn.Module:
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=4,
                vocab_size=128,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    if kind == "bert":
        return tf.BertForMaskedLM(
            tf.BertConfig(
                num_hidden_layers=2,
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=4,
                vocab_size=128,
                max_position_embeddings=64,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    return tf.LlamaForCausalLM(
        tf.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            use_cache=False,
        )
    )


def _block_mix(group: OperatorGroup, megatron: set[str]) -> set[str]:
    if group.path == "transformer.wpe":
        return {"dp"}  # broadcast over the batch: whole, with a share of the gradient
    if group.path == "transformer.add":
        return {"F"}  # hidden features split, then gathered for block 0's layer norm
    if group.path.startswith("transformer.h.0"):
        return megatron
    if group.kind == "input":
        return {"B"} if group.name == "labels" else {"R"}
    if group.kind == "loss":
        return {"B"}
    return {"B", "dp"} if group.path.startswith("transformer.h.1") else {"R", "rep"}


def _tied_mix(group: OperatorGroup, megatron: set[str]) -> set[str]:
    last = group.path.rsplit(".", 1)[-1]
    if group.kind == "input":
        return {"R"}
    if group.kind == "attention":
        return {"F"}
    if group.kind == "embedding":
        return {"vocab"} if group.inputs else {"dp"}
    if last == "c_attn":
        return {"rep"}
    if last == "c_proj" and ".attn." in group.path:
        return {"row"}
    if group.kind == "loss" or ".mlp." in group.path:
        return {"B", "dp"}
    return {"B", "dp"} if last == "lm_head" else {"R", "rep"}


def _seq_mix(group: OperatorGroup, megatron: set[str]) -> set[str]:
    """Sequence-sharded (``Q``) wherever the operator allows it (LLaMA: every operator but the
    embedding and the loss, attention over all-gathered keys; GPT-2: the residual adds and the
    final layer norm), the rest replicated."""
    if group.seq_ok and group.kind in ("layernorm", "elementwise", "add", "attention"):
        return {"Q"}
    if group.seq_ok and group.kind == "linear":
        return {"sp"}
    return {"R", "rep"}


PICKERS: dict[str, Callable[[OperatorGroup, set[str]], set[str]]] = {
    "dp": lambda group, megatron: {"B", "dp"},
    "megatron": lambda group, megatron: megatron,
    "block_mix": _block_mix,
    "tied_mix": _tied_mix,
    "seq_mix": _seq_mix,
}


@pytest.mark.parametrize(
    ("kind", "world_size", "plans"),
    [
        ("gpt2", 2, ["dp", "megatron", "block_mix", "tied_mix", "seq_mix", "ilp"]),
        ("gpt2", 4, ["megatron", "block_mix", "tied_mix", "seq_mix", "ilp"]),
        ("llama", 2, ["megatron", "seq_mix", "ilp"]),
        ("bert", 2, ["dp", "ilp", "ilp_tight"]),
    ],
)
@distributed()
def test_graph_plans_train_like_one_process(kind: str, world_size: int, plans: list[str]) -> None:
    cost = CostModel(world_size=world_size, **COST)
    torch.manual_seed(0)
    base = _model(kind)
    ids, reference, before, ref_losses = reference_causal_lm(base, STEPS, BATCH, SEQ, LR)
    first = copy.deepcopy(base)
    first(input_ids=ids[0], labels=ids[0]).loss.backward()
    ref_grads = {n: p.grad for n, p in first.named_parameters() if p.grad is not None}
    # not vacuous: every gradient is far above the absolute part of the tolerance, but a
    # separate key bias's (exactly 0 in exact arithmetic: softmax ignores a per-query constant)
    zero_grad = [n for n in ref_grads if n.endswith("key.bias")]
    assert min(float(g.abs().max()) for n, g in ref_grads.items() if n not in zero_grad) > (
        10 * GRAD_ATOL
    )
    meta_ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    meta = {"input_ids": meta_ids, "labels": meta_ids}
    groups = trace_operators(_model(kind), meta)
    graph = transformer_graph(groups, cost)
    mesh = init_device_mesh("cpu", (world_size,))
    for name in plans:
        if name == "ilp":
            budget = 0.9 * family_plan("dp", groups, cost).memory
            plan = search_free(groups, cost, budget)
            mixed = {s.name for s in plan.strategies}
            assert mixed & {"col", "row"} and mixed & {"dp"}, mixed  # really mixed
        elif name == "ilp_tight":  # BERT at 80 %: the ILP adds sequence-sharded operators
            budget = 0.8 * family_plan("dp", groups, cost).memory
            plan = search_free(groups, cost, budget)
            assert "Q" in {s.name for s in plan.strategies}
        else:
            megatron = megatron_assignment(groups)
            picks = []
            for node, group, meg in zip(graph.nodes, groups, megatron, strict=True):
                wanted = PICKERS[name](group, meg)
                picks.append(next(i for i, s in enumerate(node.strategies) if s.name in wanted))
            plan = evaluate(graph, picks, cost)
        if name == "seq_mix":
            used = {s.name for s in plan.strategies}
            assert "Q" in used and ("sp" in used) == (kind == "llama"), used
            attention = [g.name for g in groups if g.kind == "attention"]
            assert all(
                (plan.strategies[plan.nodes.index(a)].name == "Q") == (kind == "llama")
                for a in attention
            )
        model = apply_graph_plan(copy.deepcopy(base), meta, groups, plan, graph, mesh)
        if dist.get_rank() == 0:
            model.print_plan()
        # Adam hides a gradient off by a constant factor: compare the first gradients directly.
        model(input_ids=ids[0], labels=ids[0]).loss.backward()
        for param_name, grad in model.full_gradients().items():
            label = f"{kind} {name} gradient of {param_name}: "
            torch.testing.assert_close(
                grad, ref_grads[param_name], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=label.__add__
            )
        model.zero_grad(set_to_none=True)
        losses = train_causal_lm(model, ids, LR, model.local_batch)
        assert_run_matches([float(x) for x in losses], ref_losses, model.full_state_dict(),
                           reference, before, loss_atol=TOL, param_atol=PARAM_TOL,
                           label=f"{kind} {name}", exclude=zero_grad)  # fmt: skip
