"""The 1D tensor-parallelism tutorial (CHECKLIST §10, F0:6155-6302) as a test on 2 gloo ranks.

The rank function is the tutorial's code rewritten only by import (``colossalai`` →
``kolossos``); the lines marked ``# doc`` are the tutorial's. The checks after it are what the
docs promise (the printed shapes) plus numeric equivalence with the dense MLP the shards come
from. A second job runs the same layers under ``data=2 × tensor=2`` on 4 ranks from a config
file, and checks the modes that are not implemented yet fail clearly.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kolossos
import kolossos.nn as col_nn
from kolossos.legacy.nn.layer import Linear2D, Linear2p5D
from kolossos.legacy.tensor_parallel import get_parallel_input, read_tensor_parallel_settings
from kolossos.nn.layer.parallel_1d import Dropout1D, Linear1D_Col, Linear1D_Row
from kolossos.testing import spawn
from kolossos.utils import get_current_device, print_rank_0

CONFIG = dict(parallel=dict(data=1, pipeline=1, tensor=dict(size=2, mode="1d")))  # doc

DOC_OUTPUT = [
    "Weight of the first linear layer: torch.Size([256, 512])",
    "Weight of the second linear layer: torch.Size([512, 256])",
    "Output of the first linear layer: torch.Size([16, 512])",
    "Output of the second linear layer: torch.Size([16, 256])",
]


class MLP(torch.nn.Module):  # doc
    def __init__(self, dim: int = 256) -> None:  # doc
        super().__init__()  # doc
        intermediate_dim = dim * 4  # doc
        self.dense_1 = col_nn.Linear(dim, intermediate_dim)  # doc
        print_rank_0(
            f"Weight of the first linear layer: {self.dense_1.weight.transpose(0, 1).shape}"
        )  # doc
        self.activation = torch.nn.GELU()  # doc
        self.dense_2 = col_nn.Linear(intermediate_dim, dim)  # doc
        print_rank_0(
            f"Weight of the second linear layer: {self.dense_2.weight.transpose(0, 1).shape}"
        )  # doc
        self.dropout = col_nn.Dropout(0.1)  # doc

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # doc
        x = self.dense_1(x)  # doc
        print_rank_0(f"Output of the first linear layer: {x.shape}")  # doc
        x = self.activation(x)  # doc
        x = self.dense_2(x)  # doc
        print_rank_0(f"Output of the second linear layer: {x.shape}")  # doc
        x = self.dropout(x)  # doc
        return x  # doc


def _dense_copy(model: MLP) -> nn.Sequential:
    """The dense MLP the shards come from (full weights gathered: COLLECTIVE)."""
    layers = []
    for layer in (model.dense_1, model.dense_2):
        assert isinstance(layer, (Linear1D_Col, Linear1D_Row))
        full = nn.Linear(layer.in_features, layer.out_features)
        full.load_state_dict(layer.full_state())
        layers.append(full)
    return nn.Sequential(layers[0], nn.GELU(), layers[1])


def _check_dense_equivalence(model: MLP, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Eval mode (no dropout): the sharded MLP computes the dense MLP; the column output is this
    rank's slice of the dense hidden layer."""
    dense = _dense_copy(model)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)
        hidden = model.dense_1(x)
        expected = dense[0](x).chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)]
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def _tutorial(rank: int, world_size: int, port: int) -> tuple[list[str], torch.Tensor]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kolossos.launch(
            config=CONFIG,
            rank=rank,
            world_size=world_size,
            host="localhost",
            port=port,
        )  # doc
        m = MLP()  # doc
        x = torch.randn((16, 256), device=get_current_device())  # doc
        torch.distributed.broadcast(x, src=0)  # synchronize input  # doc
        y = m(x)  # doc: x = m(x)
    assert isinstance(m.dense_1, Linear1D_Col) and isinstance(m.dense_2, Linear1D_Row)
    assert isinstance(m.dropout, Dropout1D) and not m.dropout.parallel_input
    assert not get_parallel_input()  # the row layer handed a replicated output on
    _check_dense_equivalence(m, x, m.dense_1.process_group)
    return out.getvalue().splitlines(), y


def test_tp_1d_mlp_prints_documented_shapes() -> None:
    """Rank 0 prints exactly the documented shapes (rank 1 nothing); the second layer's output,
    dropout included, is identical on both ranks."""
    results = spawn(_tutorial, 2)
    (lines_0, y_0), (lines_1, y_1) = results
    assert lines_0 == DOC_OUTPUT
    assert lines_1 == []
    assert y_0.shape == (16, 256)
    torch.testing.assert_close(y_0, y_1, rtol=0, atol=0)


def _data_and_tensor(rank: int, world_size: int, port: int, config_file: str) -> list[int]:
    kolossos.launch(
        config=config_file, rank=rank, world_size=world_size, host="localhost", port=port
    )
    settings = read_tensor_parallel_settings()
    assert (settings.data_size, settings.pipeline_size, settings.tensor_size) == (2, 1, 2)
    torch.manual_seed(0)  # each data-parallel replica may start from its own weights
    m = MLP(dim=32)
    group = m.dense_1.process_group
    x = torch.randn((4, 32), generator=torch.Generator().manual_seed(rank // 2))
    _check_dense_equivalence(m, x, group)
    with pytest.raises(ValueError, match="must equal the world size"):
        read_tensor_parallel_settings(dict(parallel=dict(data=1, tensor=dict(size=2, mode="1d"))))
    ranks = dist.get_process_group_ranks(group)
    # 3D needs a cube (8 ranks): on 4 ranks launch refuses the config before any collective
    with pytest.raises(ValueError, match="3D tensor parallelism needs a cube size"):
        kolossos.launch(
            config=dict(parallel=dict(tensor=dict(size=4, mode="3d"))),
            rank=rank,
            world_size=world_size,
            host="localhost",
            port=port,
            verbose=False,
        )
    for mode, extra, cls in (("2d", {}, Linear2D), ("2.5d", {"depth": 1}, Linear2p5D)):
        with warnings.catch_warnings():  # launching again reuses the process group, with a warning
            warnings.simplefilter("ignore", RuntimeWarning)
            kolossos.launch(
                config=dict(parallel=dict(tensor=dict(size=4, mode=mode, **extra))),
                rank=rank,
                world_size=world_size,
                host="localhost",
                port=port,
                verbose=False,
            )
        assert isinstance(col_nn.Linear(4, 4), cls)  # the config's mode picks the layer
        with pytest.raises(ValueError, match="gather_output applies to 1D"):
            col_nn.Linear(4, 4, gather_output=True)
    return ranks


def test_tp_1d_groups_from_config_file(tmp_path: Path) -> None:
    """``data=2, tensor=2`` on 4 ranks from a Python config file: the tensor groups are
    consecutive rank pairs and each pair computes its dense MLP."""
    config = tmp_path / "config.py"
    config.write_text("parallel = dict(data=2, pipeline=1, tensor=dict(size=2, mode='1d'))\n")
    groups = spawn(_data_and_tensor, 4, config_file=str(config))
    assert groups == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_layers_without_tensor_parallelism_are_plain_torch() -> None:
    """Without a launch config (or without ``parallel.tensor``) the layers are torch's own."""
    assert type(col_nn.Linear(4, 8)) is nn.Linear
    assert type(col_nn.Dropout(0.1)) is nn.Dropout
    assert type(col_nn.Embedding(10, 4)) is nn.Embedding
    assert type(col_nn.LayerNorm(4)) is nn.LayerNorm
    loss = col_nn.CrossEntropyLoss(label_smoothing=0.1)  # F0:3648
    assert type(loss) is nn.CrossEntropyLoss and loss.label_smoothing == 0.1
    assert col_nn.CrossEntropyLoss(reduction=False).reduction == "none"
