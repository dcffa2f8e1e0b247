"""The 2.5D tensor-parallelism tutorial (CHECKLIST §10, F0:6515-6686) as a test on 8 gloo ranks.

The rank function is the tutorial's code with ``colossalai`` replaced by ``kolossos``; its
``col_nn.Linear`` / ``col_nn.Dropout`` build ``Linear2p5D`` / ``Dropout2p5D`` in
``mode='2.5d'``. The lines marked
``# doc`` are the tutorial's. The checks after it are the printed shapes the docs promise, the
input partition (chunk by DEP, COL, then ROW) being :func:`split_tensor_2p5d`, and numeric
equivalence with the dense MLP gathered from the shards.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

import kolossos
import kolossos.nn as col_nn
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.nn.layer.parallel_2p5d import (
    Dropout2p5D,
    Linear2p5D,
    get_groups_2p5d,
    split_tensor_2p5d,
)
from kolossos.testing import spawn
from kolossos.utils import get_current_device, print_rank_0

pytestmark = pytest.mark.dist

CONFIG = dict(parallel=dict(data=1, pipeline=1, tensor=dict(size=8, mode="2.5d", depth=2)))  # doc

DOC_OUTPUT = [
    "Weight of the first linear layer: torch.Size([128, 512])",
    "Weight of the second linear layer: torch.Size([512, 128])",
    "Input: torch.Size([4, 128])",
    "Output of the first linear layer: torch.Size([4, 512])",
    "Output of the second linear layer: torch.Size([4, 128])",
]


class MLP(torch.nn.Module):  # doc
    def __init__(self, dim: int = 256) -> None:  # doc
        super().__init__()  # doc
        intermediate_dim = dim * 4  # doc
        self.dense_1 = col_nn.Linear(dim, intermediate_dim)  # doc
        print_rank_0(f"Weight of the first linear layer: {self.dense_1.weight.shape}")  # doc
        self.activation = torch.nn.GELU()  # doc
        self.dense_2 = col_nn.Linear(intermediate_dim, dim)  # doc
        print_rank_0(f"Weight of the second linear layer: {self.dense_2.weight.shape}")  # doc
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
        full = nn.Linear(layer.in_features, layer.out_features)
        full.load_state_dict(layer.full_state())
        layers.append(full)
    return nn.Sequential(layers[0], nn.GELU(), layers[1])


def _tutorial(rank: int, world_size: int, port: int) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kolossos.launch(
            config=CONFIG, rank=rank, world_size=world_size, host="localhost", port=port
        )  # doc
        m = MLP()  # doc
        assert isinstance(m.dense_1, Linear2p5D) and isinstance(m.dense_2, Linear2p5D)
        assert isinstance(m.dropout, Dropout2p5D)  # col_nn follows parallel.tensor.mode
        x = torch.randn((16, 256), device=get_current_device())  # doc
        # partition input  # doc
        torch.distributed.broadcast(x, src=0)  # doc
        full_x = x
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_2P5D_DEP)]  # doc
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_2P5D_COL)]  # doc
        x = torch.chunk(x, 2, dim=-1)[gpc.get_local_rank(ParallelMode.PARALLEL_2P5D_ROW)]  # doc
        print_rank_0(f"Input: {x.shape}")  # doc
        y = m(x)  # doc: x = m(x)
    assert torch.equal(x, split_tensor_2p5d(full_x))
    assert y.shape == (4, 128)
    dense = _dense_copy(m)
    m.eval()  # no dropout: the shards compute the dense MLP's block
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        torch.testing.assert_close(m(x), split_tensor_2p5d(dense(full_x)), rtol=1e-5, atol=1e-5)
    groups = get_groups_2p5d()
    assert (groups.tesseract_dim, groups.tesseract_dep) == (2, 2)
    return out.getvalue().splitlines()


def test_tp_2p5d_mlp_prints_documented_shapes() -> None:
    """Rank 0 prints exactly the documented shapes, the other ranks nothing."""
    lines = spawn(_tutorial, 8)
    assert lines[0] == DOC_OUTPUT
    assert all(rank_lines == [] for rank_lines in lines[1:])
