"""GeminiPlugin checkpoints through the Booster: resharding, and moving to other plugins and back.

Recipe (as ``test_low_level_zero_checkpoint.py``): an uninterrupted one-process run on the global
batch is the reference. A chain of phases runs ``K`` steps each under one layout (Gemini, ZeRO
stage 2, DDP or no plugin, at some world size); every phase but the first builds a differently
initialised model, loads the previous phase's model + optimizer + LR scheduler checkpoint (sharded
files), trains, and saves for the next. Every loss and the final parameters must match the
reference, so the next-step loss after each hand-over is the uninterrupted one. At an unchanged
layout the resumed run must equal an uninterrupted one bit for bit, in bf16 as well (the model
file holds the fp32 masters).
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
from kolossos.booster.plugin.gemini_plugin import GeminiPlugin
from kolossos.interface import unwrap_model
from kolossos.testing import assert_moved, spawn

pytest.importorskip("safetensors")

K = 2
GLOBAL_BATCH = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}
# ~1.7 K parameters in 256..512-element chunks: several chunks, parameters split over ranks.
CHUNKS = {"hidden_dim": 32, "min_chunk_size_m": 256 / 2**20, "search_range_m": 256 / 2**20}


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
    """``gemini``, ``gemini-bf16``, ``gemini-cpu`` (everything offloaded), ``zero2``, ``ddp``
    or ``none``."""
    if layout.startswith("gemini"):
        precision = "bf16" if layout.endswith("bf16") else "fp32"
        placement = "cpu" if layout.endswith("cpu") else "static"
        return GeminiPlugin(precision=precision, placement_policy=placement, **CHUNKS)
    if layout == "zero2":
        return LowLevelZeroPlugin(stage=2, precision="fp32")
    return TorchDDPPlugin() if layout == "ddp" else None


def full_params(model: nn.Module) -> dict[str, list[Any]]:
    if hasattr(model, "named_full_tensors"):  # Gemini: gathered from the chunks (collective)
        return {k: v.float().tolist() for k, v in model.named_full_tensors()}
    return {k: v.detach().float().tolist() for k, v in unwrap_model(model).state_dict().items()}


def phase(directory: Path, layout: str, index: int, load: bool) -> tuple[list[float], Any]:
    """Build under ``layout``, load the checkpoint in ``directory`` if asked, train steps
    ``[index*K, (index+1)*K)``, save; returns the losses and the final parameters."""
    model, opt, sched = build(seed=index * 100)
    booster = Booster(plugin=plugin_of(layout))
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    if load:
        booster.load_model(model, directory / "model")
        booster.load_optimizer(opt, directory / "optim")
        booster.load_lr_scheduler(sched, directory / "lr.bin")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in range(index * K, (index + 1) * K):
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
    booster.save_model(model, directory / "model", True, True, "", 0.002, use_safetensors=True)
    booster.save_optimizer(opt, directory / "optim", shard=True, size_per_shard=0.002)
    booster.save_lr_scheduler(sched, directory / "lr.bin")
    return losses, full_params(model)


def _rank(rank: int, world_size: int, port: int, **kwargs: Any) -> Any:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    return phase(**kwargs)


def run_chain(chain: list[tuple[str, int]], directory: Path) -> tuple[list[float], Any]:
    losses: list[float] = []
    params = None
    for index, (layout, world) in enumerate(chain):
        kwargs = {"directory": directory, "layout": layout, "index": index, "load": index > 0}
        if layout == "none":  # in this process, without a process group or plugin
            got, params = phase(**kwargs)  # type: ignore[arg-type]
        else:
            got, params = spawn(_rank, world, **kwargs)[0]
        losses += got
    return losses, params


def reference(phases: int) -> tuple[list[float], dict[str, list[Any]]]:
    model, opt, sched = build(seed=0)
    losses = []
    for step in range(phases * K):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, full_params(model)


def untrained(phases: int) -> tuple[dict[str, torch.Tensor], float]:
    """The seed-0 model's parameters before training, and its loss on the last batch."""
    model, _, _ = build(seed=0)
    x, y = batch(phases * K - 1)
    with torch.no_grad():
        return dict(model.state_dict()), nn.functional.mse_loss(model(x), y).item()


CHAINS = {
    "gemini@2->gemini@4->gemini@2": [("gemini", 2), ("gemini", 4), ("gemini", 2)],
    "gemini@2->single->gemini-cpu@2": [("gemini", 2), ("none", 1), ("gemini-cpu", 2)],
    "gemini@2->zero2@2->gemini@4": [("gemini", 2), ("zero2", 2), ("gemini", 4)],
    "gemini-cpu@2->ddp@2->gemini@2": [("gemini-cpu", 2), ("ddp", 2), ("gemini", 2)],
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_resume_under_another_layout(tmp_path: Path, name: str) -> None:
    chain = CHAINS[name]
    ref_losses, ref_params = reference(len(chain))
    losses, params = run_chain(chain, tmp_path)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for name_, value in ref_params.items():
        torch.testing.assert_close(torch.tensor(params[name_]), torch.tensor(value), **TOL)
    initial = untrained(len(chain))[0]
    assert_moved(initial, {n: torch.tensor(v) for n, v in params.items()}, TOL["atol"])
    index = json.loads((tmp_path / "optim" / "pytorch_optim.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(ref_params)


@pytest.mark.parametrize("layout", ["gemini", "gemini-bf16"])
def test_resume_at_the_same_layout_is_bit_identical(tmp_path: Path, layout: str) -> None:
    def uninterrupted(rank: int, world_size: int, port: int) -> list[float]:
        kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
        model, opt, sched = build(seed=0)
        booster = Booster(plugin=plugin_of(layout))
        model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
        losses = []
        for step in range(2 * K):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x.chunk(2)[rank]).float(), y.chunk(2)[rank])
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            sched.step()
            dist.all_reduce(total := loss.detach().clone())
            losses.append(total.item() / 2)
        return losses

    expected = spawn(uninterrupted, 2)[0]
    first, _ = spawn(_rank, 2, directory=tmp_path, layout=layout, index=0, load=False)[0]
    # The second phase starts from the checkpoint: a model initialised with another seed.
    resumed, _ = spawn(_rank, 2, directory=tmp_path, layout=layout, index=1, load=True)[0]
    assert first + resumed == expected
    assert abs(expected[-1] - untrained(2)[1]) > 1e-3  # and training changed the loss
    from safetensors.torch import load_file

    files = sorted(p.name for p in (tmp_path / "model").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    for shard in shards:  # fp32 masters, also in bf16
        assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "model" / shard).values())


@pytest.fixture(scope="module")
def gpt2_modeling() -> Any:
    """transformers' GPT-2, imported once here so that forked ranks inherit it."""
    return pytest.importorskip("transformers.models.gpt2.modeling_gpt2")


def test_bf16_gpt2_saves_fp32_masters_that_from_pretrained_loads(
    tmp_path: Path, gpt2_modeling: Any
) -> None:
    """Gathered from chunks in a sharded directory: tied embeddings stored once, transformers
    loads it, and the weights are the fp32 masters, not their bf16 rounding."""
    config = gpt2_modeling.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip

    def save(rank: int, world_size: int, port: int) -> dict[str, list[Any]]:
        kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
        torch.manual_seed(0)
        model = gpt2_modeling.GPT2LMHeadModel(config)
        plugin = GeminiPlugin(precision="bf16", hidden_dim=32, min_chunk_size_m=0.004)
        booster = Booster(plugin=plugin)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        boosted, opt, _, _, _ = booster.boost(model, opt)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        booster.backward(boosted(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        booster.save_model(boosted, tmp_path / "gpt2", shard=True, size_per_shard=0.01,
                           use_safetensors=True)  # fmt: skip
        return {name: t.tolist() for name, t in boosted.named_full_tensors()}

    masters = spawn(save, 2)[0]
    index = json.loads((tmp_path / "gpt2" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    assert len(set(index["weight_map"].values())) > 1  # written shard by shard
    loaded = gpt2_modeling.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    rounded = 0
    for name, value in loaded.named_parameters():
        expected = torch.tensor(masters[name])
        assert torch.equal(value.detach().float(), expected), name
        rounded += int(not torch.equal(expected.bfloat16().float(), expected))
    assert rounded > 0  # the masters carry bits that bf16 weights would have lost
