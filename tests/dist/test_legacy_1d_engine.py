"""``kolossos.initialize`` → ``Engine`` over the legacy 1D tensor-parallel layers
(``kolossos.nn.Linear`` under ``parallel=dict(tensor=dict(size=2, mode='1d'))``) vs single-process
training of the same MLP built from plain ``nn.Linear`` (CPU/gloo).

Every rank builds the dense reference from one seed and loads its TP layers from it (each rank
cuts its shard), trains both on the same global batches (each data-parallel rank on its slice of
the batch), and compares the loss at every step and the full (gathered) parameters at the end.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import kolossos
import kolossos.nn as col_nn
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row
from kolossos.nn.layer.parallel_1d.sharding import gather_tp_full, get_tp_spec, slice_tp_shard
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
CLIP = 0.05  # below the gradient norms here, so clipping is active (needs the global TP norm)
TOL = 1e-5  # fp32 on CPU: only the order of the TP partial sums differs
TP = dict(tensor=dict(size=2, mode="1d"))
# name -> (world size, config)
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, dict(parallel=TP)),
    "tp2_dp2": (4, dict(parallel=dict(data=2, **TP))),
    "tp2_dp2_handler": (
        4,
        dict(parallel=TP, gradient_handler=[dict(type="DataParallelGradientHandler")]),
    ),
    "tp2_accumulation": (2, dict(parallel=TP, gradient_accumulation=2)),
    "tp2_clip": (2, dict(parallel=TP, clip_grad_norm=CLIP)),
}


class TPMLP(nn.Module):
    """``TinyMLP`` with ``kolossos.nn.Linear``: column-parallel ``fc1``, row-parallel ``fc2``."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.fc1 = col_nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.fc2 = col_nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _load_shards(model: nn.Module, dense: nn.Module) -> None:
    """Copy ``dense``'s full parameters into ``model``, each rank keeping its TP shard."""
    full = dict(dense.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            spec = get_tp_spec(param)
            value = full[name].detach()
            if spec is not None:
                value = slice_tp_shard(value, spec, gpc.get_local_rank(ParallelMode.TENSOR))
            param.copy_(value)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter at full size (TP shards gathered: a collective of the tensor group)."""
    out = {}
    for name, param in model.named_parameters():
        spec = get_tp_spec(param)
        out[name] = param.detach() if spec is None else gather_tp_full(param.detach(), spec)
    return out


def _reference(model: nn.Module, batches: list[Any], config: dict[str, Any]) -> list[float]:
    """Plain single-process training on the global batches."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    accumulate = config.get("gradient_accumulation", 1)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.cross_entropy(model(x), y)
        (loss / accumulate).backward()
        losses.append(float(loss.item()))
        if (i + 1) % accumulate:
            continue
        if "clip_grad_norm" in config:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip_grad_norm"])
            assert norm > 2 * config["clip_grad_norm"]  # clipping is active at every step
        sgd.step()
        sgd.zero_grad()
    return losses


def _train(rank: int, world_size: int, port: int, case: str) -> None:
    config = CASES[case][1]
    kolossos.launch(copy.deepcopy(config), rank, world_size, "localhost", port, verbose=False)
    assert gpc.get_world_size(ParallelMode.TENSOR) == 2
    dense = TinyMLP()
    model = TPMLP()
    assert isinstance(model.fc1, Linear1D_Col) and isinstance(model.fc2, Linear1D_Row)
    assert model.fc1.weight.shape == (16, 16) and model.fc2.weight.shape == (8, 16)
    _load_shards(model, dense)
    initial = snapshot(dense)
    batches = make_classification_batches(STEPS, GLOBAL_BATCH)
    dp_rank, dp_size = gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA)
    loader = [(shard(x, dp_rank, dp_size), shard(y, dp_rank, dp_size)) for x, y in batches]
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, loader, _, _ = kolossos.initialize(
        model, sgd, nn.CrossEntropyLoss(), loader, verbose=False
    )
    assert engine.criterion is not None
    engine.train()
    losses = []
    for x, y in loader:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(global_mean(loss, gpc.get_group(ParallelMode.DATA)))
    assert len(losses) == STEPS
    ref_losses = _reference(dense, batches, config)
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    full = _full_params(model)
    assert_params_close(full.items(), dense, rtol=TOL, atol=TOL)
    assert_moved(initial, full, TOL)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_engine_1d_tp_matches_single_process(case: str) -> None:
    spawn(_train, CASES[case][0], case=case)
