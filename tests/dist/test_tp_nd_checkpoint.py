"""The legacy ``save_checkpoint`` / ``load_checkpoint`` pair across the tensor-parallel modes
(issue #22, item 3): a file saved under 1D, 2D, 2.5D or 3D tensor parallelism holds the dense
tensors (``nn.Linear``'s ``(out, in)`` weights, also where a mode stores ``(in, out)`` blocks)
under the dense model's names, and loads under any other mode, under data parallelism, or in one
process without tensor parallelism.

The model is the same in every layout: ``kolossos.nn.Linear`` (which follows
``parallel.tensor.mode``) → GELU → ``kolossos.nn.Linear`` → ``kolossos.nn.LayerNorm``, with the
dense torch MLP's names. A save job builds it from one seed, takes two Adam steps on gradients
that are this rank's piece of fixed dense gradients (the same in every layout), saves, and rank 0
also writes the full parameters and Adam states gathered independently of the checkpoint code
(``ShardLayout.gather``, checked against the layers' ``full_state()`` in
``test_shard_layout.py``). A load job under another layout builds a differently seeded model,
loads, and must hold exactly the saved full parameters and states, still sharded.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import kolossos
import kolossos.nn as col_nn
from kolossos.nn.layer.shard_layout import get_shard_layout
from kolossos.testing import spawn
from kolossos.utils import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.dist

# name -> (world size, parallel config)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "single": (1, {}),
    "1d2_dp2": (4, dict(data=2, tensor=dict(size=2, mode="1d"))),
    "2d4": (4, dict(tensor=dict(size=4, mode="2d"))),
    "2p5d8": (8, dict(tensor=dict(size=8, mode="2.5d", depth=2))),
    "3d8": (8, dict(tensor=dict(size=8, mode="3d"))),
}
FULL_SHAPES = {  # the dense MLP's state dict
    "fc1.weight": (32, 16),
    "fc1.bias": (32,),
    "fc2.weight": (16, 32),
    "fc2.bias": (16,),
    "norm.weight": (16,),
    "norm.bias": (16,),
}
STATES = ("exp_avg", "exp_avg_sq")


class MLP(nn.Module):
    """The MLP of the launch's tensor mode (dense without one)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = col_nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = col_nn.Linear(32, 16)
        self.norm = col_nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(self.act(self.fc1(x))))


def _dense_grad(name: str, step: int) -> torch.Tensor:
    """A fixed dense gradient for parameter ``name`` at ``step`` (the same on every rank)."""
    seed = zlib.crc32(f"{name}/{step}".encode())
    return torch.randn(FULL_SHAPES[name], generator=torch.Generator().manual_seed(seed))


def _full(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``param`` or a state shaped like it) in the dense layout: a collective of the
    tensor group when ``param`` is a shard."""
    layout = get_shard_layout(param)
    return tensor.detach().clone() if layout is None else layout.gather(tensor.detach())


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its Adam states in the dense layout, by name (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out[name] = _full(param, param)
        state = optim.state.get(param, {})
        for key in STATES:
            if key in state:
                out[f"{name}.{key}"] = _full(state[key], param)
        if "step" in state:
            out[f"{name}.step"] = torch.as_tensor(state["step"]).detach().clone().float()
    return out


def _build(rank: int, world_size: int, port: int, layout: str, seed: int) -> Any:
    kolossos.launch(dict(parallel=LAYOUTS[layout][1]), rank, world_size, "localhost", port,
                    seed=seed, verbose=False)  # fmt: skip
    model = MLP()
    assert dict(model.state_dict()).keys() == FULL_SHAPES.keys()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _save(rank: int, world_size: int, port: int, layout: str, folder: str) -> None:
    model, optim = _build(rank, world_size, port, layout, seed=1)
    for step in range(2):
        for name, param in model.named_parameters():
            grad = _dense_grad(name, step)
            shard = get_shard_layout(param)
            param.grad = grad if shard is None else shard.shard(grad)
        optim.step()
    save_checkpoint(Path(folder) / "ckpt.pt", 5, model, optim)
    expected = _full_state(model, optim)
    if rank == 0:
        torch.save(expected, Path(folder) / "expected.pt")


def _load(rank: int, world_size: int, port: int, layout: str, folder: str) -> None:
    model, optim = _build(rank, world_size, port, layout, seed=2)
    expected = torch.load(Path(folder) / "expected.pt")
    before = _full_state(model, optim)
    assert not torch.equal(before["fc1.weight"], expected["fc1.weight"])  # a different model
    assert load_checkpoint(Path(folder) / "ckpt.pt", model, optim) == 5
    loaded = _full_state(model, optim)
    assert loaded.keys() == expected.keys(), sorted(loaded.keys() ^ expected.keys())
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=f"{layout}: {name}")
    sharded = LAYOUTS[layout][1].get("tensor") is not None
    for param in model.parameters():  # still in this layout's shards after loading
        layout_ = get_shard_layout(param)
        assert (layout_ is not None) == sharded or param.dim() == 1, layout
        for key in STATES:
            assert optim.state[param][key].shape == param.shape


@pytest.mark.parametrize(
    ("saved", "loads"),
    [
        ("single", ["2d4"]),
        ("2d4", ["single", "1d2_dp2"]),
        ("3d8", ["2p5d8", "2d4"]),
        ("2p5d8", ["single"]),
    ],
)
def test_tp_checkpoint_loads_under_another_mode(
    saved: str, loads: list[str], tmp_path: Path
) -> None:
    spawn(_save, LAYOUTS[saved][0], layout=saved, folder=str(tmp_path))
    body = torch.load(tmp_path / "ckpt.pt", mmap=True)
    assert {n: tuple(t.shape) for n, t in body["model"].items()} == FULL_SHAPES  # dense
    states = body["optimizer"]["state"]
    assert set(states) == set(FULL_SHAPES)
    for name, state in states.items():
        assert {k: tuple(state[k].shape) for k in STATES} == dict.fromkeys(
            STATES, FULL_SHAPES[name]
        )
    for loaded in loads:
        spawn(_load, LAYOUTS[loaded][0], layout=loaded, folder=str(tmp_path))
