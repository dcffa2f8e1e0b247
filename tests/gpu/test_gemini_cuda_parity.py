"""Gemini on a GPU vs plain single-device training: losses every step, parameters at the end.

One process with a single-rank NCCL group (one GPU cannot host two NCCL ranks), so this checks the
CUDA paths of the chunk layer, the placement policies (with ``cpu`` chunks really move between GPU
and host; ``auto`` under a budget that forces evictions is tests/gpu/test_gemini_budget_gpu.py),
HybridAdam stepping host shards on the CPU and device shards on the GPU, and the fp16/bf16
recipes. The reference is the same recipe written out by hand: working weights in the compute
dtype, fp32 master weights stepped by AdamW, the same loss scale. TF32 is off so that fp32 is
compared tightly.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from kolossos.testing import assert_moved, snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS, BATCH, SEQ, VOCAB = 10, 4, 64, 512
SCALE = 2.0**10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp32: only the summation order of the reductions differs. bf16/fp16: the chunked and the plain
# model round the same products, but kernels may pick different algorithms per shape.
TOL = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 3e-2), "fp16": (3e-3, 1e-2)}
# AdamW at LR with eps=1e-3 (an update proportional to a gradient below eps, not an lr-sized step
# of the sign rounding gives it) for STEPS steps on one repeated batch moves every parameter by
# 0.2-0.42 (measured in a CPU run of this recipe, which also differs from the reference by 3e-3
# in bf16, 6e-4 in fp16): 10x the tolerances (assert_moved). 4 steps at lr 1e-3 moved them by
# 4e-3 at most, below the bf16/fp16 tolerances, so those checks passed without any step. In
# bf16 each parameter must move by 2x the tolerance (the slowest, a LayerNorm bias, by 6.6x),
# the largest by 10x.
LR = 5e-2
EACH = {"fp32": None, "bf16": 2.0, "fp16": None}


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=3, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def batches() -> list[torch.Tensor]:
    """One batch, STEPS times: every step pushes a parameter the same way."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return [ids.cuda()] * STEPS


def reference(model: nn.Module, precision: str) -> tuple[list[float], nn.Module]:
    dtype = DTYPES[precision]
    work = copy.deepcopy(model).cuda().to(dtype)
    master = copy.deepcopy(model).cuda().float()
    opt = torch.optim.AdamW(master.parameters(), lr=LR, eps=1e-3)
    scale = SCALE if precision == "fp16" else 1.0
    losses = []
    for ids in batches():
        loss = work(input_ids=ids, labels=ids).loss.float()
        (loss * scale).backward()
        for m, w in zip(master.parameters(), work.parameters(), strict=True):
            assert w.grad is not None
            m.grad = w.grad.float() / scale
            w.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, w in zip(master.parameters(), work.parameters(), strict=True):
                w.copy_(m)
        losses.append(loss.item())
    return losses, master


def gemini(
    model: nn.Module, precision: str, placement: str, **kw: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from kolossos.nn.optimizer import HybridAdam
    from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer

    ddp = GeminiDDP(
        copy.deepcopy(model), chunk_config_dict={"chunk_size": 64 * 1024},
        mixed_precision=DTYPES[precision], placement_policy=placement, **kw,
    )  # fmt: skip
    opt = GeminiOptimizer(
        HybridAdam(ddp.parameters(), lr=LR, eps=1e-3, adamw_mode=True, weight_decay=0.01), ddp,
        initial_scale=SCALE, hysteresis=1,
    )  # fmt: skip
    losses = []
    for ids in batches():
        loss = ddp(input_ids=ids, labels=ids).loss.float()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # chunk by chunk: the tensors must be copied before the next chunk reuses the buffer
    return losses, {name: t.clone() for name, t in ddp.named_full_tensors()}


@pytest.mark.usefixtures("nccl_group")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("placement", ["static", "cpu", "auto"])
def test_gemini_on_cuda_matches_plain_training(precision: str, placement: str) -> None:
    model = gpt2()
    initial = snapshot(model)
    # torch's AdamW (weight decay 0.01) is what HybridAdam(adamw_mode=True) computes.
    ref_losses, master = reference(model, precision)
    losses, full = gemini(model, precision, placement)
    rtol, atol = TOL[precision]
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
    # every parameter (the tied lm_head.weight once, as transformer.wte.weight), none skipped
    expected = dict(master.named_parameters())
    missing = sorted(expected.keys() - full.keys())
    assert not missing, f"no full tensor for {missing}"
    for name, value in expected.items():
        torch.testing.assert_close(
            full[name].float().cuda(), value.detach(), rtol=rtol, atol=atol, msg=name
        )
    trained = {name: full[name] for name in expected}
    assert_moved(initial, trained, atol, each=EACH[precision])


@pytest.mark.usefixtures("nccl_group")
@pytest.mark.parametrize("placement", ["static", "cpu"])
def test_bf16_gradient_shards_bit_identical_on_cuda(placement: str) -> None:
    """bf16 gradient shards (HybridAdam widens them in the update, times the deferred clipping
    factor) against fp32 shards (the chunks' ``grad_dtype``, the one switch): the same masters
    bit for bit. ``static`` steps the masters on the GPU (in 16 Mi-element pieces),
    ``cpu`` on the host (in cache-sized pieces). tests/dist/test_gemini_bf16_grads.py is the
    CPU-rank version."""
    from kolossos.nn.optimizer import HybridAdam
    from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer

    def train(narrow: bool) -> list[torch.Tensor]:
        ddp = GeminiDDP(gpt2(), chunk_config_dict={"chunk_size": 64 * 1024},
                        mixed_precision=torch.bfloat16, placement_policy=placement)  # fmt: skip
        opt = GeminiOptimizer(HybridAdam(ddp.parameters(), lr=1e-3), ddp, max_norm=0.05)
        chunks = list(ddp.chunk_manager)
        assert all(c.grad_dtype == torch.bfloat16 for c in chunks)
        for chunk in chunks if not narrow else ():
            chunk.grad_dtype = torch.float32
        for ids in batches()[:3]:
            opt.backward(ddp(input_ids=ids, labels=ids).loss.float())
            opt.step()
            opt.zero_grad()
        return [c.master.clone() for c in chunks]

    for narrow, wide in zip(train(True), train(False), strict=True):
        torch.testing.assert_close(narrow, wide, rtol=0, atol=0)
