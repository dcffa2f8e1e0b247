"""TorchFSDPPlugin checkpoints interoperate: FSDP <-> one process <-> DDP <-> LowLevelZero, at
different world sizes, in the gathered (Hugging Face / name-keyed) format and in DCP.

Recipe (as in ``test_checkpoint_reshard.py``): one uninterrupted process on the global batch is
the reference. A run trains ``K`` steps with plugin A at world size ``a`` and saves model,
optimizer (AdamW, two parameter groups) and LR scheduler through the Booster; a freshly built,
differently initialised model with plugin B at world size ``b`` loads them and trains ``K`` more
steps. Every loss (averaged over ranks) and the final parameters must match the reference.
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
import kolossos.booster.plugin as plugins
from kolossos.booster import Booster
from kolossos.fsdp.checkpoint_io import FSDPCheckpointIO
from kolossos.interface import unwrap_model
from kolossos.testing import assert_moved, spawn

pytest.importorskip("safetensors")

K = 3
GLOBAL_BATCH = 8
RTOL, ATOL = 1e-5, 1e-6


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 33), nn.Tanh())
    model.append(nn.Linear(33, 4))  # 33 rows: uneven shards over 2 and 4 ranks
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.01, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.02, eps=1e-3)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def make_plugin(kind: str) -> Any:
    if kind == "none":
        return None
    if kind == "ddp":
        return plugins.TorchDDPPlugin()
    if kind == "zero":
        return plugins.LowLevelZeroPlugin(stage=2, precision="fp32")
    return plugins.TorchFSDPPlugin(checkpoint_format="dcp" if kind == "dcp" else "hf")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def train(booster: Booster, model: Any, opt: Any, sched: Any, steps: range) -> list[float]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
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
    state = unwrap_model(model).state_dict()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    return {k: v.detach().tolist() for k, v in full.items()}  # by value, not shared memory


def phase(kind: str, save: bool, directory: Path) -> Any:
    """Save after K steps (seed 0), or load into a fresh model (seed 123) and train K more."""
    model, optimizer, scheduler = build(seed=0 if save else 123)
    booster = Booster(plugin=make_plugin(kind))
    model, opt, _, _, sched = booster.boost(model, optimizer, lr_scheduler=scheduler)
    assert opt is not None
    ckpt = str(directory)
    if save:
        losses = train(booster, model, opt, sched, range(K))
        safetensors = kind != "dcp"  # DCP writes its own file format
        size: Any = 0.002  # MB: several shards
        booster.save_model(model, f"{ckpt}/model", True, True, "", size, safetensors)
        booster.save_optimizer(opt, f"{ckpt}/optim", shard=True, size_per_shard=size)
        booster.save_lr_scheduler(sched, f"{ckpt}/lr.bin")
        return losses
    # A plain Booster cannot read DCP; FSDP's checkpoint IO reads it into any model.
    io = FSDPCheckpointIO() if kind == "none" else booster.checkpoint_io
    io.load_model(model, directory / "model")
    io.load_optimizer(opt, directory / "optim")
    booster.load_lr_scheduler(sched, f"{ckpt}/lr.bin")
    return train(booster, model, opt, sched, range(K, 2 * K)), full_params(model)


def _rank(rank: int, world_size: int, port: int, kind: str, save: bool, directory: Path) -> Any:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    return phase(kind, save, directory)


def run(kind: str, world: int, save: bool, directory: Path) -> Any:
    if world == 1:
        return phase(kind, save, directory)  # in this process, without a process group
    return spawn(_rank, world, kind=kind, save=save, directory=directory)[0]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, list[Any]]]:
    model, optimizer, scheduler = build(seed=0)
    booster = Booster()
    model, opt, _, _, sched = booster.boost(model, optimizer, lr_scheduler=scheduler)
    losses = train(booster, model, opt, sched, range(2 * K))
    return losses, full_params(model)


CASES = [
    ("fsdp", 2, "none", 1),  # FSDP -> one process
    ("fsdp", 2, "ddp", 4),  # FSDP -> DDP at another world size
    ("ddp", 2, "fsdp", 4),  # DDP -> FSDP
    ("none", 1, "fsdp", 2),  # one process -> FSDP
    ("fsdp", 4, "fsdp", 2),  # FSDP resharded
    ("dcp", 2, "dcp", 4),  # DCP at 2 -> FSDP at 4
    ("dcp", 2, "none", 1),  # DCP at 2 -> a plain model in one process
    ("fsdp", 2, "zero", 4),  # FSDP -> LowLevelZero stage 2
    ("zero", 2, "fsdp", 4),  # LowLevelZero stage 2 -> FSDP
]


@pytest.mark.parametrize(("save_kind", "save_world", "load_kind", "load_world"), CASES)
def test_resume_across_plugins_and_world_sizes(
    tmp_path: Path, reference: Any, save_kind: str, save_world: int, load_kind: str, load_world: int
) -> None:
    ref_losses, ref_params = reference
    losses = run(save_kind, save_world, True, tmp_path)
    if save_kind == "dcp":  # every rank wrote its own shards, and no gathered files
        dcp_files = [".metadata", "__0_0.distcp", "__1_0.distcp", "kolossos_dcp.json"]
        assert sorted(p.name for p in (tmp_path / "model").iterdir()) == dcp_files
        optim_files = sorted(p.name for p in (tmp_path / "optim").iterdir())
        assert optim_files == sorted([*dcp_files, "kolossos_optim_header.bin"])
    else:
        index = json.loads((tmp_path / "optim" / "pytorch_optim.bin.index.json").read_text())
        assert set(index["weight_map"]) == set(ref_params)  # keyed by parameter name
    resumed, params = run(load_kind, load_world, False, tmp_path)
    torch.testing.assert_close(
        torch.tensor(losses + resumed), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL
    )
    assert resumed[0] != losses[-1]  # training really continued from the checkpoint
    for name, value in ref_params.items():
        actual, expected = torch.tensor(params[name]), torch.tensor(value)
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=name)
    initial = dict(build(seed=0)[0].state_dict())
    assert_moved(initial, {n: torch.tensor(v) for n, v in params.items()}, ATOL)


def _save_gpt2(rank: int, world_size: int, port: int, directory: Path) -> list[Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    booster = Booster(plugin=plugins.TorchFSDPPlugin())
    model, opt, _, _, _ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    assert opt is not None
    tokens = torch.arange(32).view(2, 16) % 64
    booster.backward(model(input_ids=tokens, labels=tokens).loss, opt)
    opt.step()
    size: Any = 0.01  # MB: a dozen shards
    booster.save_model(model, str(directory), shard=True, size_per_shard=size, use_safetensors=True)
    with torch.no_grad():
        return model(input_ids=tokens).logits.tolist()


def test_fsdp_gpt2_checkpoint_loads_with_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    logits = spawn(_save_gpt2, 2, directory=tmp_path)[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as Hugging Face does
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = loaded(input_ids=torch.arange(32).view(2, 16) % 64).logits
    torch.testing.assert_close(torch.tensor(logits), expected, rtol=1e-5, atol=1e-5)
