"""``booster.execute_pipeline`` under ``torch.no_grad()`` is forward-only (evaluation): on 2
pipeline ranks, for 1F1B, interleaved, ZB-V (split backward, V layout) and ZeRO-1, it returns the
loss and logits of the training step without touching any ``.grad``, keeps no autograd graph and
no activation after each forward; and a training step after it (whose activation streams are
negotiated separately) still gives the single-process gradients."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import HybridParallelPlugin
from kolossos.testing import distributed

pytestmark = pytest.mark.dist

SEQ, BATCH = 8, 4
# fp32, one process vs two stages: the same arithmetic, except that each micro-batch's loss and
# gradient is summed separately (float32 rounding)
TOL = 1e-5
CASES = [
    {"pp_style": "1f1b"},
    {"pp_style": "interleaved", "num_model_chunks": 2},
    {"pp_style": "zbv", "num_model_chunks": 2},
    {"pp_style": "1f1b", "zero_stage": 1},
]


def build() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def lm_loss(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


def grads_of(boosted: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for chunk in boosted.chunks for n, p in chunk.named_parameters()}


@distributed(2)
def test_forward_only_evaluation() -> None:
    ids = torch.randint(2, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    for case in CASES:
        torch.manual_seed(0)
        model = build()
        reference = copy.deepcopy(model)
        ref_out = reference(**batch)
        ref_out.loss.backward()
        ref_grads = dict(reference.named_parameters(remove_duplicate=False))
        plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2,
                                      precision="fp32", **case)  # fmt: skip
        booster = Booster(plugin=plugin)
        boosted, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        sm = plugin.stage_manager
        last = any(sm.is_last_stage(c) for c in range(sm.num_model_chunks))

        boosted.eval()
        with torch.no_grad():  # forward-only, before any training step, without an optimizer
            evaluated = booster.execute_pipeline(iter([batch]), boosted, lm_loss, None,
                                                 return_outputs=True)  # fmt: skip
        boosted.train()
        assert all(g is None for g in grads_of(boosted).values()), case  # no .grad touched
        runtime = plugin.engine.pipeline
        assert runtime is not None and runtime.schedule.last_stats is not None
        assert runtime.schedule.last_stats.peak_live == 1, case  # freed after each forward
        assert (evaluated["loss"] is not None) == last, case
        if last:
            loss, logits = evaluated["loss"], evaluated["outputs"]["logits"]
            assert loss.grad_fn is None and not loss.requires_grad, case  # no graph kept
            assert logits.grad_fn is None and not logits.requires_grad, case
            torch.testing.assert_close(loss, ref_out.loss.detach(), rtol=TOL, atol=TOL)
            torch.testing.assert_close(logits, ref_out.logits.detach(), rtol=TOL, atol=TOL)

        # the training step (grads on) after it: the same loss, the reference's gradients
        trained = booster.execute_pipeline(iter([batch]), boosted, lm_loss, opt)
        if last:
            torch.testing.assert_close(trained["loss"], evaluated["loss"], rtol=0, atol=0)
        grads = grads_of(boosted) if case.get("zero_stage", 0) == 0 else {}
        for name, grad in grads.items():
            want = ref_grads[name].grad
            assert grad is not None and want is not None, (case, name)
            torch.testing.assert_close(grad, want, rtol=TOL, atol=TOL, msg=f"{case} {name}")
        if grads:  # the gradients compared are far larger than the tolerance
            assert max(float(g.abs().max()) for g in grads.values() if g is not None) > 100 * TOL
        opt.zero_grad()
        dist.barrier()
