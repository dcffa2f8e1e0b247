"""LowLevelZeroPlugin checkpoints through the Booster: resharding and moving between plugins.

Recipe (as ``test_checkpoint_reshard.py``): an uninterrupted one-process run on the global batch is
the reference. A run trains ``K`` steps with one layout (ZeRO stage 1/2, DDP or no plugin, at
some world size), saves model + optimizer + LR scheduler through the Booster (sharded files),
then a differently initialised model under another layout loads them and trains ``K`` more
steps. Every loss and the final parameters must match the reference; at an unchanged layout the
resumed run must equal an uninterrupted one bit for bit, in bf16 as well (the model file holds
the fp32 master weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import kolossos
from kolossos.booster import Booster
from kolossos.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin
from kolossos.interface import unwrap_model
from kolossos.testing import assert_moved, spawn

pytest.importorskip("safetensors")

K = 3
GLOBAL_BATCH = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    model.append(nn.Linear(32, 4))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.02
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def plugin_of(layout: str) -> Any:
    """``zero1``, ``zero2``, ``zero2-bf16``, ``ddp`` or ``none``."""
    if layout.startswith("zero"):
        precision = "bf16" if layout.endswith("bf16") else "fp32"
        return LowLevelZeroPlugin(stage=int(layout[4]), precision=precision)
    return TorchDDPPlugin() if layout == "ddp" else None


def boosted(layout: str, seed: int) -> tuple[Booster, Any, Any, Any]:
    model, opt, sched = build(seed)
    booster = Booster(plugin=plugin_of(layout))
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def train(booster: Booster, model: Any, opt: Any, sched: Any, steps: range) -> list[float]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x.chunk(world)[rank]).float(), y.chunk(world)[rank])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_params(model: nn.Module) -> dict[str, list[Any]]:
    return {k: v.detach().float().tolist() for k, v in unwrap_model(model).state_dict().items()}


def save_phase(directory: Path, layout: str) -> list[float]:
    booster, model, opt, sched = boosted(layout, seed=0)
    losses = train(booster, model, opt, sched, range(K))
    booster.save_model(model, directory / "model", True, True, "", 0.002, use_safetensors=True)
    booster.save_optimizer(opt, directory / "optim", shard=True, size_per_shard=0.002)
    booster.save_lr_scheduler(sched, directory / "lr.bin")
    return losses


def load_phase(directory: Path, layout: str) -> tuple[list[float], dict[str, list[Any]]]:
    booster, model, opt, sched = boosted(layout, seed=123)
    booster.load_model(model, directory / "model")
    booster.load_optimizer(opt, directory / "optim")
    booster.load_lr_scheduler(sched, directory / "lr.bin")
    return train(booster, model, opt, sched, range(K, 2 * K)), full_params(model)


def _rank(rank: int, world_size: int, port: int, phase: Any, directory: Path, layout: str) -> Any:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    return phase(directory, layout)


def run(fn: Any, layout: str, world: int, directory: Path) -> Any:
    if layout == "none":  # in this process, without a process group or plugin
        return fn(directory, layout)
    return spawn(_rank, world, phase=fn, directory=directory, layout=layout)[0]


def untrained() -> tuple[dict[str, torch.Tensor], float]:
    """The seed-0 model's parameters before training, and its loss on the last batch."""
    model, _, _ = build(seed=0)
    x, y = batch(2 * K - 1)
    with torch.no_grad():
        return dict(model.state_dict()), nn.functional.mse_loss(model(x), y).item()


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, list[Any]]]:
    booster, model, opt, sched = boosted("none", seed=0)
    losses = train(booster, model, opt, sched, range(2 * K))
    return losses, full_params(model)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        (("zero2", 4), ("zero2", 2)),
        (("zero1", 4), ("zero2", 1)),
        (("zero2", 4), ("none", 1)),
        (("ddp", 2), ("zero1", 4)),
        (("zero1", 2), ("ddp", 4)),
    ],
    ids=[
        "zero2@4->zero2@2",
        "zero1@4->zero2@1",
        "zero2@4->single",
        "ddp@2->zero1@4",
        "zero1@2->ddp@4",
    ],
)
def test_resume_under_another_layout(
    tmp_path: Path, reference: Any, saved: tuple[str, int], loaded: tuple[str, int]
) -> None:
    ref_losses, ref_params = reference
    losses = run(save_phase, *saved, tmp_path)
    index = json.loads((tmp_path / "optim" / "pytorch_optim.bin.index.json").read_text())
    assert set(index["weight_map"]) == {n for n in ref_params if n.endswith(("weight", "bias"))}
    resumed, params = run(load_phase, *loaded, tmp_path)
    torch.testing.assert_close(torch.tensor(losses + resumed), torch.tensor(ref_losses), **TOL)
    assert resumed[0] != losses[-1]  # training really continued from the checkpoint
    for name, value in ref_params.items():
        torch.testing.assert_close(torch.tensor(params[name]), torch.tensor(value), **TOL, msg=name)
    assert_moved(untrained()[0], {n: torch.tensor(v) for n, v in params.items()}, TOL["atol"])


@pytest.mark.parametrize("layout", ["zero2", "zero1-bf16"])
def test_resume_at_the_same_layout_is_bit_identical(tmp_path: Path, layout: str) -> None:
    def uninterrupted(directory: Path, layout: str) -> list[float]:
        booster, model, opt, sched = boosted(layout, seed=0)
        return train(booster, model, opt, sched, range(2 * K))

    expected = run(uninterrupted, layout, 2, tmp_path)
    losses = run(save_phase, layout, 2, tmp_path)
    resumed, _ = run(load_phase, layout, 2, tmp_path)
    assert losses + resumed == expected
    assert abs(expected[-1] - untrained()[1]) > 1e-3  # and training changed the loss
    files = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert "model.safetensors.index.json" in files and "config.json" not in files
    from safetensors.torch import load_file

    shard = load_file(tmp_path / "model" / files[0])
    assert all(t.dtype == torch.float32 for t in shard.values())  # fp32 masters, also in bf16


@pytest.fixture(scope="module")
def gpt2_modeling() -> Any:
    """transformers' GPT-2, imported once here so that forked ranks inherit it."""
    return pytest.importorskip("transformers.models.gpt2.modeling_gpt2")


def test_bf16_gpt2_saves_fp32_masters_that_from_pretrained_loads(
    tmp_path: Path, gpt2_modeling: Any
) -> None:
    """Tied embeddings are stored once; transformers loads the directory; the weights are the
    fp32 masters, not their bf16 rounding."""
    config = gpt2_modeling.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip

    def save(rank: int, world_size: int, port: int) -> dict[str, list[Any]]:
        kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
        torch.manual_seed(0)
        model = gpt2_modeling.GPT2LMHeadModel(config)
        booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="bf16"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        boosted, opt, _, _, _ = booster.boost(model, opt)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        booster.backward(boosted(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        booster.save_model(boosted, tmp_path / "gpt2", shard=True, size_per_shard=0.01,
                           use_safetensors=True)  # fmt: skip
        return {name: opt.full_param(p, dst=None).tolist() for name, p in model.named_parameters()}

    masters = spawn(save, 2)[0]
    index = json.loads((tmp_path / "gpt2" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    loaded = gpt2_modeling.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    rounded = 0
    for name, value in loaded.named_parameters():
        expected = torch.tensor(masters[name])
        assert torch.equal(value.detach().float(), expected), name
        rounded += int(not torch.equal(expected.bfloat16().float(), expected))
    assert rounded > 0  # the masters carry bits that bf16 weights would have lost
