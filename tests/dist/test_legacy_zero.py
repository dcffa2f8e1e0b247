"""``zero=dict(...)`` in the launch config: ``kolossos.initialize`` -> Engine over the Booster's
ZeRO engines (LowLevelZero stages 1/2, Gemini stage 3) on 2 ranks vs single-process training
(CPU/gloo). Losses every step, full parameters at the end, and that they moved."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import kolossos
from kolossos.amp import AMP_TYPE, convert_to_amp
from kolossos.engine.gradient_handler import ZeROGradientHandler
from kolossos.interface import unwrap_model
from kolossos.testing import spawn
from kolossos.testing.parity import (
    TinyMLP,
    assert_moved,
    assert_params_close,
    global_mean,
    make_classification_batches,
    shard,
    snapshot,
)

STEPS = 6
GLOBAL_BATCH = 16
LR = 0.5
CLIP = 0.05  # below the gradient norms here: clipping is active
SCALE = 2.0**10
# name -> (config, reference AMP mode, tolerance). fp32 differs only in the order of sums; fp16
# as NAIVE AMP (fp16 model, fp32 masters) whose gradients each rank rounds before reducing.
CASES: dict[str, tuple[dict[str, Any], AMP_TYPE | None, float]] = {
    "stage1_fp32": (dict(zero=dict(stage=1, precision="fp32")), None, 1e-5),
    "stage2_fp32_clip": (
        dict(zero=dict(stage=2, precision="fp32"), clip_grad_norm=CLIP),
        None,
        1e-5,
    ),
    "stage2_fp16": (
        dict(zero=dict(stage=2, optimizer_config=dict(initial_scale=SCALE))),
        AMP_TYPE.NAIVE,
        5e-3,
    ),
    "stage3_fp32": (
        dict(
            zero=dict(
                precision="fp32",
                model_config=dict(tensor_placement_policy="cpu", shard_strategy="tensor"),
            )
        ),
        None,
        1e-5,
    ),
    "stage3_fp32_accumulation": (
        dict(zero=dict(precision="fp32"), gradient_accumulation=2),
        None,
        1e-5,
    ),
}


def _reference(model: torch.nn.Module, batches: list[Any], case: str) -> list[float]:
    config, mode, _ = CASES[case]
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    criterion: Any = torch.nn.CrossEntropyLoss()
    optim: Any = sgd
    if mode is not None:
        model, optim, criterion = convert_to_amp(
            model, sgd, criterion, mode, dict(mode=mode, initial_scale=SCALE)
        )
    accumulate = config.get("gradient_accumulation", 1)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = criterion(model(x), y)
        (optim.backward(loss / accumulate) if mode else (loss / accumulate).backward())
        losses.append(float(loss.item()))
        if (i + 1) % accumulate:
            continue
        if "clip_grad_norm" in config:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optim.step()
        optim.zero_grad()
    return losses


def _train(rank: int, world_size: int, port: int, case: str) -> None:
    config, _, tol = CASES[case]
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    batches = make_classification_batches(STEPS, GLOBAL_BATCH)
    loader = [(shard(x, rank, world_size), shard(y, rank, world_size)) for x, y in batches]
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, loader, _, _ = kolossos.initialize(
            model, sgd, torch.nn.CrossEntropyLoss(), loader, verbose=False
        )
    if case == "stage3_fp32":  # Colossal-AI's shard_strategy is decided by the engine
        assert any("shard_strategy" in str(w.message) for w in caught)
    handlers = engine.gradient_handlers
    assert len(handlers) == 1
    inner = getattr(handlers[0], "grad_handler", handlers[0])  # wrapped under accumulation
    assert isinstance(inner, ZeROGradientHandler)
    engine.train()
    losses = []
    data = iter(loader)
    for _ in range(STEPS):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(data)
        engine.step()
        losses.append(global_mean(loss))
    ref_losses = _reference(reference, batches, case)
    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    if "stage3" in case:  # GeminiDDP gathers its chunks (on every rank here)
        state = engine.model.state_dict(only_rank_0=False)
    else:
        state = unwrap_model(engine.model).state_dict()
    full = {k: v.float() for k, v in state.items()}
    assert_params_close(full.items(), reference, rtol=tol, atol=tol)
    assert_moved(initial, full, tol)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_zero_config_matches_single_process(case: str) -> None:
    spawn(_train, 2, case=case)


def _refused(rank: int, world_size: int, port: int) -> None:
    config = dict(zero=dict(stage=2), parallel=dict(tensor=dict(size=2, mode="1d")))
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    model = TinyMLP()
    with pytest.raises(NotImplementedError, match=r"tensor size 2.*HybridParallelPlugin"):
        kolossos.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), verbose=False)


@pytest.mark.dist
def test_zero_with_tensor_parallelism_is_refused_before_any_collective() -> None:
    spawn(_refused, 2)
