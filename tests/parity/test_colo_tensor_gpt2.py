"""An unmodified Hugging Face GPT-2 built under ``ColoInitContext(default_pg=...)`` and sharded
by the documents' ``tensor_parallelize`` recipe (tp=2) trains like the single-process model, on
4 CPU ranks with tp=2 x dp=2 (data-parallel gradients averaged over the ProcessGroup's dp group):
loss every step, full parameters at the end, and every parameter moved far beyond the tolerance.

Tiny model: 2 layers, hidden 32, 4 heads, vocabulary 64, sequence 8, dropout off, eager
attention, fp32, AdamW.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kolossos.tensor import ColoParameter, ProcessGroup, ShardSpec, full_state_dict
from kolossos.testing import distributed
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot
from kolossos.utils.model.colo_init_context import ColoInitContext

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "tensor"))
from gpt2_tp_recipe import tensor_parallelize  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 4
SEQ = 8
# fp32: tensor parallelism changes only the order of sums (row-split matmuls, the all-reduce of
# partial results, the dp gradient average); measured worst ~1e-6
TOL = 1e-5


def build() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for n, p in model.named_parameters()
    }


def run(shardinit: bool, gemini: bool = False) -> None:
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    torch.manual_seed(0)
    ref = build()
    spec = ShardSpec([-1], [2]) if shardinit else None
    with ColoInitContext(device="cpu", default_pg=pg, default_dist_spec=spec):
        model = build()
    params = list(model.parameters())
    assert params and all(isinstance(p, ColoParameter) for p in params)
    with torch.no_grad():  # the same start as the reference
        for (_, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            p.copy_(
                DTensor.from_local(r.detach().clone(), p.device_mesh, run_check=False).redistribute(
                    p.device_mesh, p.placements
                )
            )
    tensor_parallelize(model, pg)
    assert model.transformer.h[0].mlp.c_fc.weight.size_local() == (32, 64)
    assert model.transformer.h[0].mlp.c_proj.weight.size_local() == (64, 32)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, cut once
    initial = snapshot(ref)
    if gemini:
        from kolossos.nn.optimizer import HybridAdam
        from kolossos.zero import GeminiDDP, GeminiOptimizer

        model = GeminiDDP(model, placement_policy="cpu", mixed_precision=torch.float32)
        adam = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3, adamw_mode=True)
        opt = GeminiOptimizer(adam, model, initial_scale=1.0, min_scale=1.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)
    gen = torch.Generator().manual_seed(1)
    dp_group, dp_rank = pg.dp_process_group(), pg.dp_local_rank()
    for step in range(STEPS):
        ids = torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=gen)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = shard(ids, dp_rank, pg.dp_world_size())
        loss = model(input_ids=mine, labels=mine).loss
        if gemini:
            opt.backward(loss)  # Gemini reduces the pieces' gradients over dp
        else:
            loss.backward()
            for p in model.parameters():  # data parallelism: average gradients over dp
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                dist.all_reduce(p.grad.to_local(), group=dp_group)
                p.grad.to_local().div_(pg.dp_world_size())
        opt.step()
        opt.zero_grad()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        got = global_mean(local, dp_group)
        assert abs(got - ref_loss.item()) <= TOL, (step, got, ref_loss.item())
    if gemini:
        from kolossos.zero.gemini.colo_params import tp_full_state_dict

        state = tp_full_state_dict(model)  # HF layout: the unsharded model's full tensors
        final = {n: state[n] for n in full_params(ref)}
    else:
        state = full_state_dict(model)
        final = full_params(model)
    for name, value in full_params(ref).items():
        torch.testing.assert_close(final[name], value, rtol=TOL, atol=TOL, msg=name)
    assert_moved(initial, final, atol=TOL)
    # the checkpoint gathers to the full tensors of the Hugging Face model
    fresh = build()
    fresh.load_state_dict(state)
    ids = torch.randint(0, 64, (2, SEQ), generator=gen)
    logits = model(input_ids=ids).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    torch.testing.assert_close(fresh(input_ids=ids).logits, logits, rtol=TOL, atol=TOL)


@distributed(4)
def test_gpt2_megatron_recipe_tp2_dp2() -> None:
    run(shardinit=False)


@distributed(4)
def test_gpt2_megatron_recipe_shardinit() -> None:
    run(shardinit=True)


@distributed(4)
def test_gpt2_megatron_recipe_tp2_gemini_dp2() -> None:
    run(shardinit=False, gemini=True)
