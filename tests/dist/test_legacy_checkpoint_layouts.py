"""The legacy ``save_checkpoint`` / ``load_checkpoint`` pair loads under a different parallel
layout than it was saved with (CHECKLIST §4.5), with the legacy 1D tensor-parallel layers.

A job trains an MLP of ``kolossos.nn.Linear`` layers for two steps through ``kolossos.initialize``
under one layout and saves a checkpoint; rank 0 also writes the full (gathered) parameters and
Adam states, gathered here independently of the checkpoint code. A second job under another
layout builds a differently seeded model, loads the checkpoint and must hold exactly the saved
full parameters and optimizer states. Layouts: 1D tensor parallel size 2, one process without
tensor parallelism, data parallel size 2, and tensor 2 x data 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import kolossos
import kolossos.nn as col_nn
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.nn.layer.parallel_1d.sharding import gather_tp_full, get_tp_spec
from kolossos.testing import spawn
from kolossos.testing.parity import make_classification_batches, shard
from kolossos.utils import load_checkpoint, save_checkpoint

TP = dict(tensor=dict(size=2, mode="1d"))
# name -> (world size, config)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, dict(parallel=TP)),
    "single": (1, {}),
    "dp2": (2, {}),
    "tp2_dp2": (4, dict(parallel=dict(data=2, **TP))),
}
FULL_SHAPES = {
    "fc1.weight": (32, 16),
    "fc1.bias": (32,),
    "fc2.weight": (8, 32),
    "fc2.bias": (8,),
}


class TPMLP(nn.Module):
    """Two ``kolossos.nn.Linear`` layers (column- then row-parallel under 1D TP)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = col_nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = col_nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _full(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``param`` itself or a state shaped like it) at full size: a collective of the
    tensor group when ``param`` is a TP shard."""
    spec = get_tp_spec(param)
    return tensor.detach().clone() if spec is None else gather_tp_full(tensor.detach(), spec)


def _full_state(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every parameter and its Adam states at full size, by name (a collective)."""
    module = model.module if isinstance(model, DDP) else model
    optim = optimizer.unwrap() if hasattr(optimizer, "unwrap") else optimizer
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        out[name] = _full(param, param)
        state = optim.state.get(param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{name}.{key}"] = _full(state[key], param)
        if "step" in state:
            out[f"{name}.step"] = torch.as_tensor(state["step"]).detach().clone().float()
    return out


def _build(rank: int, world_size: int, port: int, layout: str, seed: int) -> tuple[Any, Any]:
    kolossos.launch(LAYOUTS[layout][1], rank, world_size, "localhost", port, seed=seed,
                    verbose=False)  # fmt: skip
    model = TPMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, _, _, _ = kolossos.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    return engine, model


def _save(rank: int, world_size: int, port: int, layout: str, folder: str) -> None:
    engine, _ = _build(rank, world_size, port, layout, seed=1)
    dp_rank, dp_size = gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA)
    engine.train()
    for x, y in make_classification_batches(2, 8):
        engine.zero_grad()
        loss = engine.criterion(engine(shard(x, dp_rank, dp_size)), shard(y, dp_rank, dp_size))
        engine.backward(loss)
        engine.step()
    save_checkpoint(Path(folder) / "ckpt.pt", 3, engine.model, engine.optimizer)
    expected = _full_state(engine.model, engine.optimizer)
    if rank == 0:
        torch.save(expected, Path(folder) / "expected.pt")


def _load(rank: int, world_size: int, port: int, layout: str, folder: str) -> None:
    engine, model = _build(rank, world_size, port, layout, seed=2)
    expected = torch.load(Path(folder) / "expected.pt")
    before = _full_state(engine.model, engine.optimizer)
    assert not torch.equal(before["fc1.weight"], expected["fc1.weight"])  # a different model
    epoch = load_checkpoint(Path(folder) / "ckpt.pt", engine.model, engine.optimizer)
    assert epoch == 3
    loaded = _full_state(engine.model, engine.optimizer)
    assert loaded.keys() == expected.keys(), sorted(loaded.keys() ^ expected.keys())
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    if get_tp_spec(model.fc1.weight) is not None:  # still sharded after loading
        assert model.fc1.weight.shape == (16, 16) and model.fc2.weight.shape == (8, 16)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ("tp2", "single"),
        ("tp2", "dp2"),
        ("single", "tp2"),
        ("dp2", "tp2"),
        ("tp2_dp2", "tp2"),
        ("tp2", "tp2_dp2"),
    ],
)
def test_legacy_checkpoint_loads_under_another_layout(
    saved: str, loaded: str, tmp_path: Path
) -> None:
    spawn(_save, LAYOUTS[saved][0], layout=saved, folder=str(tmp_path))
    body = torch.load(tmp_path / "ckpt.pt", mmap=True)
    assert {n: tuple(t.shape) for n, t in body["model"].items()} == FULL_SHAPES  # full tensors
    spawn(_load, LAYOUTS[loaded][0], layout=loaded, folder=str(tmp_path))
