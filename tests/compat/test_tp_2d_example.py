"""The 2D tensor-parallelism tutorial (CHECKLIST §10 / §20.11, F0:6323-6494) as a test on 4 gloo
ranks.

The rank function is the tutorial's code with ``colossalai`` replaced by ``kolossos``; its
``col_nn.Linear`` / ``col_nn.Dropout`` build ``Linear2D`` / ``Dropout2D`` in ``'2d'`` mode
(:mod:`kolossos.legacy.nn.layer.parallel_2d`). The lines marked ``# doc`` are the tutorial's.
The checks after it are what the docs promise — the printed shapes — plus numeric equivalence
with the dense MLP the blocks come from.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kolossos
import kolossos.nn as col_nn
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.nn.layer.parallel_2d import Dropout2D, Linear2D, get_groups_2d
from kolossos.testing import spawn
from kolossos.utils import get_current_device, print_rank_0

pytestmark = pytest.mark.dist

CONFIG = dict(parallel=dict(data=1, pipeline=1, tensor=dict(size=4, mode="2d")))  # doc

DOC_OUTPUT = [
    "Weight of the first linear layer: torch.Size([128, 512])",
    "Weight of the second linear layer: torch.Size([512, 128])",
    "Input: torch.Size([8, 128])",
    "Output of the first linear layer: torch.Size([8, 512])",
    "Output of the second linear layer: torch.Size([8, 128])",
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
    """The dense MLP the blocks come from (full weights gathered: COLLECTIVE)."""
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
        assert isinstance(m.dense_1, Linear2D) and isinstance(m.dense_2, Linear2D)
        assert isinstance(m.dropout, Dropout2D)  # col_nn follows parallel.tensor.mode
        x = torch.randn((16, 256), device=get_current_device())  # doc
        # partition input  # doc
        torch.distributed.broadcast(x, src=0)  # doc
        full_x = x
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_2D_COL)]  # doc
        x = torch.chunk(x, 2, dim=-1)[gpc.get_local_rank(ParallelMode.PARALLEL_2D_ROW)]  # doc
        print_rank_0(f"Input: {x.shape}")  # doc
        y = m(x)  # doc: x = m(x)
    groups = get_groups_2d()
    assert dist.get_process_group_ranks(groups.row) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(groups.col) == [rank % 2, rank % 2 + 2]
    # train mode: dropout draws an independent mask on every rank (seed(ParallelMode.TENSOR))
    kept = (y != 0).float()
    masks = [torch.empty_like(kept) for _ in range(world_size)]
    dist.all_gather(masks, kept)
    assert not torch.equal(masks[0], masks[1])
    dense = _dense_copy(m)
    m.eval()
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        expected = dense(full_x).chunk(2, 0)[groups.row_index].chunk(2, -1)[groups.col_index]
        torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)
    return out.getvalue().splitlines()


def test_tp_2d_mlp_prints_documented_shapes() -> None:
    """Rank 0 prints exactly the documented shapes (the others nothing), and the 2D MLP computes
    the dense MLP's blocks."""
    lines = spawn(_tutorial, 4)
    assert lines[0] == DOC_OUTPUT
    assert lines[1:] == [[], [], []]


def _without_2d_groups(rank: int, world_size: int, port: int) -> None:
    kolossos.launch(
        config=dict(parallel=dict(tensor=dict(size=2, mode="1d"))),
        rank=rank,
        world_size=world_size,
        host="localhost",
        port=port,
        verbose=False,
    )
    with pytest.raises(RuntimeError, match="mode='2d'"):
        Linear2D(4, 4)


def test_tp_2d_layers_need_2d_launch() -> None:
    """Outside a 2D launch the facade names the config that creates its groups."""
    spawn(_without_2d_groups, 2)
