"""The contention factor re-prices plans: compute terms slowed, communication not; an injected
factor moves the family choice exactly where the re-priced times cross (fixed costs, no
process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from kolossos.auto_parallel import CostModel
from kolossos.auto_parallel.calibrate import contended
from kolossos.auto_parallel.module_graph import trace_operators
from kolossos.auto_parallel.transformer_plan import (
    FAMILIES,
    family_plan,
    family_plans,
    hybrid_plan,
    search_transformer_plan,
)

BATCH, SEQ = 8, 24
# Every compute constant non-zero, so that each one's scaling is seen.
COMPUTE = {"flops_per_s": 5e9, "op_s": 2e-6, "op_byte_s": 1e-10, "optimizer_tensor_s": 1e-6,
           "optimizer_byte_s": 1e-10}  # fmt: skip


def _gpt2() -> tf.GPT2LMHeadModel:
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


def _trace(batch: int) -> list:
    ids = torch.empty(batch, SEQ, dtype=torch.long, device="meta")
    return trace_operators(_gpt2(), {"input_ids": ids, "labels": ids})


@pytest.fixture(scope="module")
def groups():
    return _trace(BATCH), _trace(BATCH // 2)


def test_contended_cost_model() -> None:
    cost = CostModel(world_size=4, alpha=1e-4, beta=1e-8, copy_byte_s=1e-10, **COMPUTE)
    slow = contended(cost, 2.5)
    assert slow.compute(1e9) == pytest.approx(2.5 * cost.compute(1e9))
    assert slow.optimizer(3, 1e6) == pytest.approx(2.5 * cost.optimizer(3, 1e6))
    for name in ("op_s", "op_byte_s", "copy_byte_s"):
        assert getattr(slow, name) == pytest.approx(2.5 * getattr(cost, name))
    for fn in (slow.all_reduce, slow.all_gather, slow.all_to_all, slow.ring_bytes):
        assert fn(1e6) == getattr(cost, fn.__name__)(1e6)
    assert contended(cost, 1.0) == cost
    with pytest.raises(ValueError, match=r"contention=0\.5 must be >= 1"):
        contended(cost, 0.5)


@pytest.mark.parametrize("family", [*FAMILIES, "dp2xtp2"])
def test_repriced_plan_scales_compute_not_communication(groups, family: str) -> None:
    full, half = groups
    factor = 3.0
    # copy_byte_s = 0: communication is alpha-beta only (the flat-buffer copy is CPU work and
    # is scaled; checked below).
    cost = CostModel(world_size=4, alpha=1e-4, beta=1e-8, **COMPUTE)

    def plan(c: CostModel):
        return hybrid_plan(half, c, 2) if family == "dp2xtp2" else family_plan(family, full, c)

    base, slow = plan(cost), plan(contended(cost, factor))
    assert [s.name for s in slow.strategies] == [s.name for s in base.strategies]
    compute = sum(s.compute_s for s in base.strategies)
    assert compute > 0
    for b, s in zip(base.strategies, slow.strategies, strict=True):
        assert s.compute_s == pytest.approx(factor * b.compute_s, rel=1e-12, abs=1e-18)
        assert s.comm_s == b.comm_s
    assert slow.reshard_s == base.reshard_s
    extra = slow.step_time - base.step_time  # a hybrid plan's dp sync is communication
    assert extra == pytest.approx((factor - 1) * compute, rel=1e-9)
    assert slow.memory == base.memory
    if family == "dp":  # the gradient copies into and out of the flat buffer: scaled
        copy_only = dataclasses.replace(cost, alpha=0.0, beta=0.0, copy_byte_s=1e-10)
        b2, s2 = plan(copy_only), plan(contended(copy_only, factor))
        moved = sum(s.comm_s for s in b2.strategies)
        assert moved > 0
        assert sum(s.comm_s for s in s2.strategies) == pytest.approx(factor * moved)


def test_injected_factor_changes_the_choice_where_the_prices_cross(groups) -> None:
    full, _ = groups
    # Slow gradient all-reduce: at factor 1 replicating is fastest; data parallelism computes
    # 1/P of the batch, so a slow enough compute makes it win.
    cost = CostModel(world_size=2, alpha=1e-4, beta=1e-7, **COMPUTE)
    lines = {}  # family -> (compute, communication) at factor 1: step(f) = f * compute + comm
    for family, (plan, _) in family_plans(full, cost).items():
        compute = sum(s.compute_s for s in plan.strategies)
        lines[family] = (compute, plan.step_time - compute)
    assert search_transformer_plan(full, cost)[0] == "replicated"
    # Where the replicated line is crossed first.
    crossings = {
        f: (lines[f][1] - lines["replicated"][1]) / (lines["replicated"][0] - lines[f][0])
        for f in lines
        if f != "replicated" and lines[f][0] < lines["replicated"][0]
    }
    winner = min(crossings, key=lambda f: crossings[f])
    at = crossings[winner]
    assert winner == "dp" and 1.5 < at < 20, crossings
    assert search_transformer_plan(full, contended(cost, 0.95 * at))[0] == "replicated"
    assert search_transformer_plan(full, contended(cost, 1.05 * at))[0] == "dp"
    # Far beyond, the family with the least compute per rank wins.
    least = min(lines, key=lambda f: (lines[f][0], lines[f][1]))
    assert search_transformer_plan(full, contended(cost, 1e4))[0] == least
