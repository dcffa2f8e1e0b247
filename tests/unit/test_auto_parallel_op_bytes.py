"""The per-byte cost of memory-bound operators: ``OperatorGroup.op_bytes``, its calibration and
its price in the transformer strategies (no process group)."""

from __future__ import annotations

from dataclasses import replace

import torch
import transformers as tf

from kolossos.auto_parallel import ColoTracer, CostModel
from kolossos.auto_parallel.calibrate import measure_compute
from kolossos.auto_parallel.module_graph import build_module_graph
from kolossos.auto_parallel.transformer_strategies import transformer_graph

BATCH, SEQ, HIDDEN = 2, 8, 32


def _groups():  # type: ignore[no-untyped-def]
    config = tf.GPT2Config(n_layer=1, n_embd=HIDDEN, n_head=4, vocab_size=64, n_positions=16,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    traced = ColoTracer().trace(model, {"input_ids": ids, "labels": ids})
    return build_module_graph(traced, model, ["input_ids", "labels"])


def test_op_bytes_count_memory_bound_outputs() -> None:
    by_name = {g.name: g for g in _groups()}
    tokens = BATCH * SEQ
    # tanh-GELU writes several tokens x 4H fp32 tensors (mul, pow, add, tanh, ...).
    gelu = by_name["transformer.h.0.mlp.act"]
    assert gelu.kind == "elementwise"
    assert gelu.op_bytes >= 4 * tokens * 4 * HIDDEN * 4
    # A linear's matmul output is FLOPs, not memory-bound bytes.
    assert by_name["transformer.h.0.mlp.c_fc"].op_bytes < tokens * 4 * HIDDEN * 4


def test_op_byte_s_prices_op_bytes() -> None:
    groups = _groups()
    base = CostModel(world_size=2, flops_per_s=1e10, op_s=1e-6)
    priced = replace(base, op_byte_s=1e-9)
    for group, a, b in zip(groups, transformer_graph(groups, base).nodes,
                           transformer_graph(groups, priced).nodes, strict=True):  # fmt: skip
        for s0, s1 in zip(a.strategies, b.strategies, strict=True):
            # Replicated strategies run every byte; batch- and feature-sharded ones 1/P.
            share = {"R": 1.0, "rep": 1.0, "B": 0.5, "F": 0.5}.get(s0.name)
            if share is None or group.kind == "input":
                continue
            expected = 1e-9 * group.op_bytes * share
            assert abs((s1.compute_s - s0.compute_s) - expected) <= 1e-15 + 1e-9 * expected


def test_measure_compute_op_byte_s() -> None:
    measured = measure_compute(tokens=64, hidden=16, repeats=3)
    assert measured["op_byte_s"] >= 0.0
    assert measured["op_s"] > 0.0 and measured["flops_per_s"] > 0.0
