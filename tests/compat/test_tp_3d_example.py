"""The 3D tensor-parallelism tutorial (CHECKLIST §10, F0:6706-6904) as a test on 8 gloo ranks.

The rank function is the tutorial's code with ``colossalai`` replaced by ``kolossos``; its
``col_nn.Linear`` / ``col_nn.Dropout`` build ``Linear3D`` / ``Dropout3D`` in mode ``'3d'``. The
lines marked ``# doc`` are the tutorial's. The
checks after it are the printed shapes the docs promise, and numeric equivalence with the dense
MLP the shards come from (eval mode, so no dropout).
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kolossos
import kolossos.nn as col_nn
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.nn.layer.parallel_3d import (
    Accuracy3D,
    Classifier3D,
    CrossEntropyLoss3D,
    Dropout3D,
    LayerNorm3D,
    Linear3D,
    get_groups_3d,
)
from kolossos.legacy.nn.layer.parallel_3d import split_batch_3d as facade_split_batch_3d
from kolossos.nn.layer.parallel_1d._comm import all_gather_along
from kolossos.nn.layer.parallel_3d import Groups3D, split_batch_3d, split_tensor_3d
from kolossos.testing import spawn
from kolossos.utils import get_current_device, print_rank_0

CONFIG = dict(parallel=dict(data=1, pipeline=1, tensor=dict(size=8, mode="3d")))  # doc

DOC_OUTPUT = [
    "Weight of the first linear layer: torch.Size([128, 256])",
    "Weight of the second linear layer: torch.Size([512, 64])",
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


def _check_dense_equivalence(m: MLP, x_full: torch.Tensor) -> None:
    """The sharded MLP computes the dense one on this rank's block (eval: no dropout)."""
    dense = []
    for layer in (m.dense_1, m.dense_2):
        full = nn.Linear(layer.in_features, layer.out_features)
        full.load_state_dict(layer.full_state())  # COLLECTIVE
        dense.append(full)
    groups_in, groups_out = m.dense_1.groups, m.dense_2.output_groups
    m.eval()
    with torch.no_grad():
        x = split_tensor_3d(split_batch_3d(x_full, groups_in), -1, groups_in.output)
        expected = dense[1](torch.nn.functional.gelu(dense[0](x_full)))
        expected = split_tensor_3d(split_batch_3d(expected, groups_out), -1, groups_out.output)
        torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


def _check_head_on_env_groups(y: torch.Tensor, x_full: torch.Tensor) -> None:
    """Layers built after the MLP take the env's current roles, i.e. the layout of the MLP's
    output: a LayerNorm3D + Classifier3D head, the loss and the accuracy equal the dense ones."""
    norm, head = LayerNorm3D(256, eps=1e-5), Classifier3D(256, 10)
    criterion, accuracy = CrossEntropyLoss3D(), Accuracy3D()
    norm.eval()
    dense_norm, dense_head = nn.LayerNorm(256), nn.Linear(256, 10)
    dense_norm.load_state_dict(norm.full_state())
    dense_head.load_state_dict(head.full_state())
    groups = get_groups_3d()
    targets = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(0))
    y_full = _gather_blocks(y, groups)  # COLLECTIVE
    logits = head(norm(y))
    dense_logits = dense_head(dense_norm(y_full))
    torch.testing.assert_close(logits, split_batch_3d(dense_logits, groups), rtol=1e-5, atol=1e-5)
    loss = criterion(logits, targets)
    torch.testing.assert_close(loss, F.cross_entropy(dense_logits, targets), rtol=1e-5, atol=1e-5)
    assert accuracy(logits, targets).item() == (dense_logits.argmax(-1) == targets).sum().item()
    assert torch.equal(facade_split_batch_3d(x_full), split_batch_3d(x_full, groups))


def _gather_blocks(y: torch.Tensor, groups: Groups3D) -> torch.Tensor:
    """The full activation from every rank's ``(batch/q**2, features/q)`` block, in row order."""
    y = all_gather_along(y, -1, groups.output)  # features
    y = all_gather_along(y, 0, groups.input)  # rows, inner split
    return all_gather_along(y, 0, groups.weight)  # rows, outer split


def _tutorial(rank: int, world_size: int, port: int) -> tuple[list[str], str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kolossos.launch(
            config=CONFIG,
            rank=rank,
            world_size=world_size,
            host="localhost",
            port=port,
        )  # doc
        groups_at_start = get_groups_3d()
        m = MLP()  # doc
        assert isinstance(m.dense_1, Linear3D) and isinstance(m.dense_2, Linear3D)
        assert isinstance(m.dropout, Dropout3D)  # col_nn follows parallel.tensor.mode
        x = torch.randn((16, 256), device=get_current_device())  # doc
        # partition input
        torch.distributed.broadcast(x, src=0)  # doc
        x_full = x.clone()
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_3D_WEIGHT)]  # doc
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_3D_INPUT)]  # doc
        x = torch.chunk(x, 2, dim=-1)[gpc.get_local_rank(ParallelMode.PARALLEL_3D_OUTPUT)]  # doc
        print_rank_0(f"Input: {x.shape}")  # doc
        y = m(x)  # doc: x = m(x)
    # Two linear layers swapped the input/output roles twice: the env is back where it started.
    assert get_groups_3d().input is groups_at_start.input
    assert m.dense_2.groups.input is groups_at_start.output
    assert y.shape == (4, 128)
    _check_dense_equivalence(m, x_full)
    with pytest.raises(ValueError, match="multiple of 4"):
        Linear3D(256, 1022)  # out_features must divide by q**2
    _check_head_on_env_groups(y.detach(), x_full)
    return out.getvalue().splitlines(), repr(tuple(m.dense_1.weight.shape))


@pytest.mark.dist
def test_tp_3d_mlp_prints_documented_shapes() -> None:
    """Rank 0 prints exactly the documented shapes, the other ranks nothing; every rank holds
    blocks of the documented shapes."""
    results = spawn(_tutorial, 8)
    assert results[0][0] == DOC_OUTPUT
    assert all(lines == [] for lines, _ in results[1:])
    assert {shape for _, shape in results} == {"(128, 256)"}
