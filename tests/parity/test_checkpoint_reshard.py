"""Resharding: a checkpoint saved through the Booster at one world size resumes at another.

Recipe: an uninterrupted one-process run on the global batch is the reference. The resumed runs
train ``K`` steps at world size ``a`` (DDP on 1/a of each global batch, or no plugin at a = 1),
save model + optimizer + LR scheduler through the Booster, then load at world size ``b`` into a
freshly built (differently initialised) model and train ``K`` more steps. Every loss (averaged
over ranks) and the final parameters must match the reference; in fp32 on CPU the only
difference is the order of the gradient sums.
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
from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.testing import assert_moved, spawn

pytest.importorskip("safetensors")

K = 3  # steps before and after the checkpoint
GLOBAL_BATCH = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    model.append(nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def train(booster: Booster | None, model: Any, opt: Any, sched: Any, steps: range) -> list[float]:
    """Train on this rank's share of each global batch; return the global mean losses."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in steps:
        x, y = batch(step)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = nn.functional.mse_loss(model(x), y)
        if booster is None:
            loss.backward()
        else:
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def boosted(seed: int, world: int) -> tuple[Booster, Any, Any, Any]:
    model, opt, sched = build(seed)
    booster = Booster(plugin=TorchDDPPlugin() if world > 1 else None)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def full_params(model: nn.Module) -> dict[str, list[Any]]:
    """The parameters as nested lists: ranks return them to the parent by value (tensors would
    travel as shared-memory handles that can outlive the rank that owns them)."""
    from kolossos.interface import unwrap_model

    return {k: v.detach().tolist() for k, v in unwrap_model(model).state_dict().items()}


def first_half(directory: Path, world: int) -> list[float]:
    """Train K steps at ``world`` ranks and save everything through the Booster."""
    booster, model, opt, sched = boosted(seed=0, world=world)
    losses = train(booster, model, opt, sched, range(K))
    booster.save_model(model, directory / "model", True, True, "", 0.002, use_safetensors=True)
    booster.save_optimizer(opt, directory / "optim", shard=True, size_per_shard=0.002)
    booster.save_lr_scheduler(sched, directory / "lr.bin")
    return losses


def second_half(directory: Path, world: int) -> tuple[list[float], dict[str, list[Any]]]:
    """Build a different model at ``world`` ranks, load the checkpoint, train K more steps."""
    booster, model, opt, sched = boosted(seed=123, world=world)
    booster.load_model(model, directory / "model")
    booster.load_optimizer(opt, directory / "optim")
    booster.load_lr_scheduler(sched, directory / "lr.bin")
    return train(booster, model, opt, sched, range(K, 2 * K)), full_params(model)


def _rank(rank: int, world_size: int, port: int, phase: str, directory: Path) -> Any:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    if phase == "save":
        return first_half(directory, world_size)
    return second_half(directory, world_size)


def run(phase: str, world: int, directory: Path) -> Any:
    if world == 1:  # in this process, without a process group or plugin
        return first_half(directory, 1) if phase == "save" else second_half(directory, 1)
    results = spawn(_rank, world, phase=phase, directory=directory)
    return results[0]


def untrained() -> tuple[dict[str, torch.Tensor], float]:
    """The seed-0 model's parameters before training, and its loss on the last batch."""
    model, _, _ = build(seed=0)
    x, y = batch(2 * K - 1)
    with torch.no_grad():
        return dict(model.state_dict()), nn.functional.mse_loss(model(x), y).item()


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, list[Any]]]:
    model, opt, sched = build(seed=0)
    losses = train(None, model, opt, sched, range(2 * K))
    return losses, full_params(model)


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (2, 4), (1, 4), (4, 2)])
def test_resume_at_another_world_size(
    tmp_path: Path, reference: Any, save_world: int, load_world: int
) -> None:
    ref_losses, ref_params = reference
    losses = run("save", save_world, tmp_path)
    index = json.loads((tmp_path / "optim" / "pytorch_optim.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(ref_params)  # keyed by parameter name
    resumed, params = run("load", load_world, tmp_path)
    torch.testing.assert_close(torch.tensor(losses + resumed), torch.tensor(ref_losses), **TOL)
    assert resumed[0] != losses[-1]  # training really continued from the checkpoint
    for name, value in ref_params.items():
        torch.testing.assert_close(torch.tensor(params[name]), torch.tensor(value), **TOL, msg=name)
    assert_moved(untrained()[0], {n: torch.tensor(v) for n, v in params.items()}, TOL["atol"])


def test_resume_at_the_same_world_size_is_bit_identical(tmp_path: Path) -> None:
    """At an unchanged world size the resumed run equals an uninterrupted one exactly."""

    def uninterrupted(rank: int, world_size: int, port: int) -> list[float]:
        kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
        booster, model, opt, sched = boosted(seed=0, world=world_size)
        return train(booster, model, opt, sched, range(2 * K))

    expected = spawn(uninterrupted, 2)[0]
    losses = run("save", 2, tmp_path)
    resumed, _ = run("load", 2, tmp_path)
    assert losses + resumed == expected
    assert abs(expected[-1] - untrained()[1]) > 1e-3  # and training changed the loss
