"""``clip_grad_norm`` under the legacy tensor parallelism: the Engine clips by the whole
model's norm (shards summed over ``ParallelMode.TENSOR``), not by each rank's local shard norm.
2 ranks (1D, tensor size 2) vs a single process training the dense MLP, fp32 and fp16 NAIVE
(CPU/gloo): losses every step, full parameters at the end, and that they moved."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import kolossos
import kolossos.nn as col_nn
from kolossos.amp import AMP_TYPE, convert_to_amp
from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row
from kolossos.testing import spawn
from kolossos.testing.parity import (
    assert_moved,
    assert_params_close,
    make_classification_batches,
    snapshot,
)

STEPS = 6
LR = 2.0
CLIP = 0.05  # well below the gradient norms: every step clips
SCALE = 2.0**10
TP = dict(parallel=dict(tensor=dict(size=2, mode="1d")), clip_grad_norm=CLIP)
CASES: dict[str, tuple[dict[str, Any], AMP_TYPE | None, float]] = {
    "fp32": (TP, None, 1e-5),
    "naive_amp": (
        {**TP, "fp16": dict(mode=AMP_TYPE.NAIVE, initial_scale=SCALE)},
        AMP_TYPE.NAIVE,
        1e-3,
    ),
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = col_nn.Linear(16, 32)  # column-parallel
        self.act = nn.ReLU()
        self.fc2 = col_nn.Linear(32, 8)  # row-parallel: the logits are whole on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _dense(model: MLP) -> nn.Sequential:
    """The dense MLP (COLLECTIVE: gathers the shards)."""
    layers = []
    for layer in (model.fc1, model.fc2):
        assert isinstance(layer, (Linear1D_Col, Linear1D_Row))
        full = nn.Linear(layer.in_features, layer.out_features)
        full.load_state_dict(layer.full_state())
        layers.append(full)
    return nn.Sequential(layers[0], nn.ReLU(), layers[1])


def _full(model: MLP) -> dict[str, torch.Tensor]:
    dense = _dense(model)
    return {n.replace("0.", "fc1.").replace("2.", "fc2."): p for n, p in dense.named_parameters()}


def _reference(model: nn.Sequential, batches: list[Any], mode: AMP_TYPE | None) -> list[float]:
    optim: Any = torch.optim.SGD(model.parameters(), lr=LR)
    criterion: Any = nn.CrossEntropyLoss()
    if mode is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optim, criterion = convert_to_amp(  # type: ignore[assignment]
                model, optim, criterion, mode, dict(mode=mode, initial_scale=SCALE)
            )
    losses = []
    for x, y in batches:
        loss = criterion(model(x), y)
        optim.backward(loss) if mode else loss.backward()
        norm = (optim.clip_grad_by_norm(CLIP) if mode
                else torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))  # fmt: skip
        assert float(norm) > 2 * CLIP  # clipping is active
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.item()))
    return losses


def _train(rank: int, world_size: int, port: int, case: str) -> None:
    config, mode, tol = CASES[case]
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    torch.manual_seed(0)
    model = MLP()
    reference = _dense(model)
    initial = _full(model)
    batches = make_classification_batches(STEPS, 8)  # every rank of the tensor group: all data
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = kolossos.initialize(model, sgd, nn.CrossEntropyLoss(), verbose=False)
    losses = []
    for x, y in batches:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    ref_losses = _reference(reference, batches, mode)
    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    trained = _full(model)
    expected = {n.replace("0.", "fc1.").replace("2.", "fc2."): p
                for n, p in reference.named_parameters()}  # fmt: skip
    assert_params_close(trained.items(), expected.items(), rtol=tol, atol=tol)
    assert_moved(snapshot(initial), trained, tol)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_clipping_uses_the_whole_models_norm(case: str) -> None:
    spawn(_train, 2, case=case)
