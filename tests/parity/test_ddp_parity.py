"""TorchDDPPlugin vs single-process training: precisions, accumulation, clipping (CPU/gloo)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from kolossos.booster import Booster
from kolossos.booster.mixed_precision import FP16NaiveMixedPrecision
from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.interface import unwrap_model
from kolossos.testing import distributed
from kolossos.testing.parity import (
    TinyMLP,
    assert_moved,
    assert_params_close,
    assert_same_on_all_ranks,
    global_mean,
    make_classification_batches,
    shard,
    snapshot,
)

# STEPS SGD steps (momentum 0.9) at LR move every parameter by 0.32 or more, 10x the bf16
# parameter tolerance and more (assert_moved); 4 steps at lr 0.1 moved fc1.bias by 0.018.
STEPS = 8
GLOBAL_BATCH = 16
LR = 0.5
# (loss rtol, param rtol/atol): fp32 is exact up to summation order; low precision differs because
# each rank rounds its own shard's activations, not the whole batch's.
TOL = {
    "fp32": (1e-5, 1e-5),
    "bf16": (2e-2, 2e-2),
    "fp16": (2e-3, 2e-3),
    "fp16_naive": (5e-3, 5e-3),
}


def _train(
    booster: Booster,
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    clip: Callable[[Any], None] | None = None,
) -> tuple[list[float], torch.nn.Module]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    assert optimizer is not None and criterion is not None
    losses = []
    for x, y in batches:
        loss = criterion(model(shard(x, rank, world)), shard(y, rank, world))
        booster.backward(loss, optimizer)
        if clip is not None:
            clip(optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(loss) if world > 1 else float(loss.item()))
    return losses, unwrap_model(model)


def _mixed_precision(precision: str) -> Any:
    if precision == "fp16_naive":  # from its default scale 2**32 every step here overflowed and
        return FP16NaiveMixedPrecision(initial_scale=2**10)  # was skipped: nothing trained
    return None if precision == "fp32" else precision


def _reference(precision: str) -> Booster:
    return Booster(mixed_precision=_mixed_precision(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp16_naive"])
@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_ddp_matches_single_process(world_size: int, precision: str) -> None:
    rank = dist.get_rank()
    model = TinyMLP()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    batches = make_classification_batches(STEPS, GLOBAL_BATCH)
    plugin = TorchDDPPlugin()
    mp = _mixed_precision(precision)
    losses, trained = _train(
        Booster(mixed_precision=mp, plugin=plugin), model, batches, rank, world_size
    )
    ref_losses, ref_trained = _train(_reference(precision), reference, batches, 0, 1)
    loss_rtol, param_tol = TOL[precision]
    torch.testing.assert_close(losses, ref_losses, rtol=loss_rtol, atol=loss_rtol)
    assert_params_close(trained, ref_trained, rtol=param_tol, atol=param_tol)
    assert_moved(initial, trained, param_tol)
    assert_same_on_all_ranks(trained)


@pytest.mark.parametrize("mode", ["norm", "value"])
@distributed(2)
def test_clipping_matches_single_process(mode: str) -> None:
    rank = dist.get_rank()
    model = TinyMLP()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    batches = make_classification_batches(STEPS, GLOBAL_BATCH)
    norms: list[float] = []

    def clip(optimizer: Any) -> None:
        if mode == "norm":
            norms.append(float(optimizer.clip_grad_by_norm(0.05)))
        else:
            optimizer.clip_grad_by_value(0.01)

    losses, trained = _train(Booster(plugin=TorchDDPPlugin()), model, batches, rank, 2, clip)
    ref_norms = list(norms)
    norms.clear()
    ref_losses, ref_trained = _train(Booster(), reference, batches, 0, 1, clip)
    if mode == "norm":  # the clip was active (norm above the limit) and the norms agree
        assert min(norms) > 0.05
        torch.testing.assert_close(ref_norms, norms, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_close(trained, ref_trained, rtol=1e-5, atol=1e-6)
    assert_moved(initial, trained, 1e-6)


class _CommCounter:
    """Counts the bucket all-reduces of a DDP model through a communication hook."""

    def __init__(self) -> None:
        self.calls = 0

    def hook(self):  # type: ignore[no-untyped-def]
        # DDP checks the hook's annotations at run time, so they must be real objects here.
        def counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
            self.calls += 1
            return allreduce_hook(state, bucket)  # type: ignore[arg-type]

        counting_hook.__annotations__ = {
            "state": object,
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        return counting_hook


def _same_on_all_ranks(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is bitwise equal on every rank (a collective)."""
    assert tensor is not None
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(t, gathered[0]) for t in gathered)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_accumulation_equals_large_batch(world_size: int) -> None:
    rank = dist.get_rank()
    accum = 4
    model = TinyMLP()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    micro = make_classification_batches(accum * 2, 8, seed=3)  # 2 optimizer steps
    booster = Booster(plugin=TorchDDPPlugin())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    assert optimizer is not None and criterion is not None
    counter = _CommCounter()
    model.module.register_comm_hook(None, counter.hook())
    weight = next(unwrap_model(model).parameters())
    first = weight.detach().clone()
    # Every accumulation window (both optimizer steps): inside no_sync no bucket is all-reduced,
    # each rank keeps the gradient of its own micro-batches (they differ between ranks) and the
    # weights stay put; the synchronising backward makes the gradients equal on every rank.
    for i, (x, y) in enumerate(micro):
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        if (i + 1) % accum != 0:
            before = counter.calls
            with booster.no_sync(model):  # forward and backward both inside, as DDP requires
                booster.backward(criterion(model(xs), ys) / accum, optimizer)
            assert counter.calls == before, f"gradient communication inside no_sync (batch {i})"
            assert not _same_on_all_ranks(weight.grad), f"gradients reduced in no_sync (batch {i})"
            assert torch.equal(weight, first), f"weights changed inside no_sync (batch {i})"
        else:
            before = counter.calls
            booster.backward(criterion(model(xs), ys) / accum, optimizer)
            assert counter.calls > before, "no gradient communication on the sync step"
            assert _same_on_all_ranks(weight.grad), f"gradients not reduced (batch {i})"
            optimizer.step()
            optimizer.zero_grad()
            first = weight.detach().clone()

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        xs = torch.cat([micro[step * accum + j][0] for j in range(accum)])
        ys = torch.cat([micro[step * accum + j][1] for j in range(accum)])
        torch.nn.functional.cross_entropy(reference(xs), ys).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(unwrap_model(model), reference, rtol=1e-5, atol=1e-6)
    assert_moved(initial, unwrap_model(model), 1e-6)


@distributed(2)
def test_fp16_overflow_skips_step_on_every_rank() -> None:
    rank = dist.get_rank()
    model = TinyMLP()
    booster = Booster(mixed_precision="fp16", plugin=TorchDDPPlugin())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, torch.nn.CrossEntropyLoss())
    assert optimizer is not None and criterion is not None
    x, y = make_classification_batches(1, 8)[0]
    before = [p.detach().clone() for p in unwrap_model(model).parameters()]
    scale = optimizer.loss_scale  # type: ignore[attr-defined]
    booster.backward(criterion(model(shard(x, rank, 2)), shard(y, rank, 2)), optimizer)
    if rank == 1:  # after the all-reduce: only this rank sees the overflow
        next(unwrap_model(model).parameters()).grad.view(-1)[0] = float("inf")  # type: ignore
    assert optimizer.step() is None
    assert optimizer.last_step_skipped  # type: ignore[attr-defined]
    assert optimizer.loss_scale == scale / 2  # type: ignore[attr-defined]
    for p, b in zip(unwrap_model(model).parameters(), before, strict=True):
        assert torch.equal(p, b)
    # the next, clean step goes through on every rank and keeps them identical
    booster.backward(criterion(model(shard(x, rank, 2)), shard(y, rank, 2)), optimizer)
    optimizer.step()
    assert not optimizer.last_step_skipped  # type: ignore[attr-defined]
    assert_same_on_all_ranks(unwrap_model(model))
