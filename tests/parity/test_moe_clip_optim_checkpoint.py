"""MoeHybridParallelPlugin (4 ranks, pp=1): clipping by the global norm and optimizer checkpoints.

* Clipping: ``max_norm`` below every step's gradient norm, so it clips at every step; SGD with
  momentum (its update is proportional to the gradient, so a wrong clip factor shows). The
  reference is single-process HF Mixtral with ``clip_grad_norm_``; losses every step, every
  parameter at the end within 2e-5 (experts gathered), every parameter moved 10x that. ep 2 x
  dp 2 with DDP, ZeRO-1 and ZeRO-2, and ep 4 with ZeRO-1.
* Optimizer checkpoints: train 3 steps, ``save_model`` + ``save_optimizer``, train 2 more (the
  uninterrupted run); a fresh model and optimizer at the same or another layout load both and
  train the same 2 steps: losses and final parameters equal the uninterrupted run's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import MoeHybridParallelPlugin
from kolossos.interface import unwrap_model
from kolossos.moe import moe_info_of
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot

pytestmark = pytest.mark.dist

SEQ = 16
GLOBAL_BATCH = 4
TOL = 2e-5
MAX_NORM = 0.1  # the reference's norms are ~1: clipping acts at every step


def build(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


def batch(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(2, 128, (GLOBAL_BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        info, value = moe_info_of(p), p.detach()
        if info is not None and info.ep_group is not None:
            parts = [torch.empty_like(value) for _ in range(info.ep_size)]
            dist.all_gather(parts, value.contiguous(), group=info.ep_group)
            value = torch.cat(parts)
        out[name] = value.clone()
    return out


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=5.0, momentum=0.9)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)


def step(booster: Booster, model: Any, opt: Any, plugin: Any, data: dict[str, Any]) -> float:
    mine = {k: shard(v, plugin.mesh.dp_rank, plugin.mesh.dp_size) for k, v in data.items()}
    loss = model(**mine).loss
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    return global_mean(loss)


def check_clip(**kwargs: Any) -> None:
    model = build()
    ref = copy.deepcopy(model)
    initial = snapshot(model)
    ref_opt = sgd(ref)
    plugin = MoeHybridParallelPlugin(precision="fp32", max_norm=MAX_NORM, **kwargs)
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, sgd(model))
    losses, ref_losses, norms = [], [], []
    for i in range(4):
        losses.append(step(booster, boosted, opt, plugin, batch(i)))
        ref_loss = ref(**batch(i)).loss
        ref_loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    assert min(norms) > 2 * MAX_NORM, norms
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    trained = full_params(unwrap_model(boosted))
    theirs = dict(ref.named_parameters())
    for name, value in trained.items():
        torch.testing.assert_close(value, theirs[name].detach(), rtol=TOL, atol=TOL, msg=name)
    assert_moved(initial, trained, TOL)


def check_resume(root: Path, save: dict[str, Any], load: dict[str, Any]) -> None:
    """Save at layout ``save`` after 3 steps; the run resumed at layout ``load`` equals the
    uninterrupted one over the next 2 steps."""
    model = build()
    plugin = MoeHybridParallelPlugin(precision="fp32", **save)
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, adamw(model))
    for i in range(3):
        step(booster, boosted, opt, plugin, batch(i))
    booster.save_model(boosted, root / "model", shard=True)
    booster.save_optimizer(opt, root / "optim", shard=True)
    at_save = full_params(unwrap_model(boosted))
    expected = [step(booster, boosted, opt, plugin, batch(i)) for i in (3, 4)]
    final = full_params(unwrap_model(boosted))

    fresh = build(seed=1)  # other initial weights: everything must come from the checkpoint
    plugin2 = MoeHybridParallelPlugin(precision="fp32", **load)
    booster2 = Booster(plugin=plugin2)
    boosted2, opt2, *_ = booster2.boost(fresh, adamw(fresh))
    booster2.load_model(boosted2, root / "model")
    booster2.load_optimizer(opt2, root / "optim")
    resumed = [step(booster2, boosted2, opt2, plugin2, batch(i)) for i in (3, 4)]
    torch.testing.assert_close(resumed, expected, rtol=TOL, atol=TOL)
    got = full_params(unwrap_model(boosted2))
    for name, value in got.items():
        torch.testing.assert_close(value, final[name], rtol=TOL, atol=TOL, msg=name)
    assert_moved(at_save, final, TOL)  # the two resumed steps moved every parameter


@distributed(4)
def test_clip_and_optimizer_checkpoint(tmp_path: Path) -> None:
    @parameterize("zero_stage", [0, 1, 2])
    def clip(zero_stage: int) -> None:
        check_clip(ep_size=2, zero_stage=zero_stage)

    clip()
    check_clip(ep_size=4, zero_stage=1)

    layouts: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("same_ddp", {"ep_size": 2}, {"ep_size": 2}),
        ("same_zero1", {"ep_size": 2, "zero_stage": 1}, {"ep_size": 2, "zero_stage": 1}),
        ("ep4", {"ep_size": 2, "zero_stage": 1}, {"ep_size": 4, "zero_stage": 1}),
        ("ep1_ddp", {"ep_size": 2, "zero_stage": 1}, {"ep_size": 1}),
    ]
    for name, save, load in layouts:
        check_resume(tmp_path / name, save, load)
