"""``kolossos.initialize`` → ``Engine`` on 2 ranks vs single-process training: fp32 (torch DDP),
each AMP mode, gradient accumulation, clipping, the data-parallel gradient handler and a
user-registered handler (CPU/gloo). Losses every step, parameters at the end."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kolossos
from kolossos.amp import AMP_TYPE, convert_to_amp
from kolossos.engine import BaseGradientHandler
from kolossos.registry import GRADIENT_HANDLER
from kolossos.testing import spawn
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

STEPS = 8  # iterations (optimizer steps, except under gradient accumulation: STEPS / 2)
GLOBAL_BATCH = 16
LR = 0.5
CLIP = 0.05  # below the gradient norms here, so clipping is active
# name -> (config, fp16 mode for the reference, loss and parameter tolerance)
CASES: dict[str, tuple[dict[str, Any], AMP_TYPE | None, float]] = {
    "fp32_ddp": ({}, None, 1e-5),
    "torch_amp": (dict(fp16=dict(mode=AMP_TYPE.TORCH)), AMP_TYPE.TORCH, 2e-3),
    # from NAIVE's default scale 2**32 every step overflows and is skipped: nothing would train
    "naive_amp": (
        dict(fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=2**10)),
        AMP_TYPE.NAIVE,
        5e-3,
    ),
    "apex_amp": (dict(fp16=dict(mode=AMP_TYPE.APEX)), AMP_TYPE.APEX, 2e-3),
    "accumulation": (dict(gradient_accumulation=2), None, 1e-5),
    "clip": (dict(clip_grad_norm=CLIP), None, 1e-5),
    "dp_handler": (dict(gradient_handler=[dict(type="DataParallelGradientHandler")]), None, 1e-5),
    "user_handler": (dict(gradient_handler=[dict(type="SumScaleHandler", scale=0.5)]), None, 1e-5),
}


class SumScaleHandler(BaseGradientHandler):
    """A user handler (the documented recipe): sum over the world, then scale."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, scale: float) -> None:
        super().__init__(model, optimizer)
        self.scale = scale
        self.calls = 0

    def handle_gradient(self) -> None:
        self.calls += 1
        for p in self._model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.mul_(self.scale)


def _reference(
    model: torch.nn.Module, batches: list[Any], mode: AMP_TYPE | None, case: str
) -> list[float]:
    """Single-process training on the global batches (plain torch, or the same AMP recipe)."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.7)
    criterion: Any = torch.nn.CrossEntropyLoss()
    optim: Any = sgd
    if mode is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # APEX says which recipe runs instead
            model, optim, criterion = convert_to_amp(
                model, sgd, criterion, mode, CASES[case][0]["fp16"]
            )
    accumulate = 2 if case == "accumulation" else 1
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = criterion(model(x), y)
        (optim.backward(loss / accumulate) if mode else (loss / accumulate).backward())
        losses.append(float(loss.item()))
        if (i + 1) % accumulate:
            continue
        if case == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optim.step()
        optim.zero_grad()
        sched.step()
    return losses


def _train(rank: int, world_size: int, port: int, case: str) -> None:
    config, mode, tol = CASES[case]
    if not GRADIENT_HANDLER.has("SumScaleHandler"):
        GRADIENT_HANDLER.register_module(SumScaleHandler)
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    batches = make_classification_batches(STEPS, GLOBAL_BATCH)
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.7)
    loader = [(shard(x, rank, world_size), shard(y, rank, world_size)) for x, y in batches]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # APEX says which recipe runs instead
        engine, loader, _, sched = kolossos.initialize(
            model, sgd, torch.nn.CrossEntropyLoss(), loader, lr_scheduler=sched, verbose=False
        )
    assert isinstance(engine.model, DDP) == (case in ("fp32_ddp", "torch_amp", "apex_amp",
                                                      "accumulation", "clip"))  # fmt: skip
    engine.train()
    losses = []
    data = iter(loader)
    for i in range(STEPS):
        if i % 2:  # the schedule, and the documented hand-written loop
            engine.zero_grad()
            _, _, loss = engine.execute_schedule(data)
        else:
            x, y = next(data)
            engine.zero_grad()
            loss = engine.criterion(engine(x), y)
            engine.backward(loss)
        engine.step()
        sched.step()
        losses.append(global_mean(loss))
        if case == "accumulation" and i == 0:  # no update inside a cycle
            assert_params_close(model, initial.items(), rtol=0, atol=0)
    ref_losses = _reference(reference, batches, mode, case)
    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    assert_params_close(model, reference, rtol=tol, atol=tol)
    assert_moved(initial, model, tol)
    assert_same_on_all_ranks(model)
    if case == "user_handler":
        assert engine.gradient_handlers[0].calls == STEPS  # type: ignore[attr-defined]
    if case == "accumulation":
        assert sched.get_last_lr()[0] == pytest.approx(LR * 0.7 ** (STEPS // 2))


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_single_process(case: str) -> None:
    spawn(_train, 2, case=case)
