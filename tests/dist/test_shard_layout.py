"""The :class:`~kolossos.nn.layer.shard_layout.ShardLayout` contract, for every parameter of
every layer type of every tensor mode, on 8 ranks (1D and 2D in two blocks of 4 ranks, 2.5D with
``q=2, d=2`` and 3D with ``q=2`` over all 8):

* :func:`get_shard_layout` finds the mark (each layer has marked parameters; an unmarked one,
  e.g. a row-parallel or classifier bias, is replicated and its full tensor is the parameter);
* ``layout.gather(p)`` is exactly ``module.full_state()[name]`` (the dense layout, transposed back
  where the mode stores ``(in, out)`` blocks), of ``layout.full_shape``;
* ``layout.shard(full)`` is exactly ``p`` (and of ``layout.shard_shape()``);
* ``replicas`` counts each element once: ``sum over the tensor group of |p|^2 / replicas`` is the
  dense ``|full|^2`` (padding rows are zeros), and the legacy engine's gradient norm
  (``ModelParallelGradNorm``, which reads ``replicas``) of the parameters used as gradients is the
  dense norm, for ``p = 2`` and ``p = inf``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kolossos
from kolossos.legacy.engine.grad_norm import ModelParallelGradNorm
from kolossos.nn.layer import parallel_1d as p1d
from kolossos.nn.layer import parallel_2d as p2d
from kolossos.nn.layer import parallel_2p5d as p2p5d
from kolossos.nn.layer import parallel_3d as p3d
from kolossos.nn.layer.shard_layout import get_shard_layout
from kolossos.testing import spawn

pytestmark = pytest.mark.dist

BLOCK = 4  # ranks of a 1D group and of a 2D grid


def _blocks() -> tuple[dist.ProcessGroup, p2d.Groups2D]:
    """A 1D group and a 2x2 grid over each block of 4 consecutive ranks (every rank creates
    every group, in the same order)."""
    me = dist.get_rank()
    found: dict[str, dist.ProcessGroup] = {}
    for base in range(0, dist.get_world_size(), BLOCK):
        lists = {
            "tp": [list(range(base, base + BLOCK))],
            "row": [[base + 2 * i + j for j in range(2)] for i in range(2)],
            "col": [[base + 2 * i + j for i in range(2)] for j in range(2)],
        }
        for role, rank_lists in lists.items():
            for ranks in rank_lists:
                group = dist.new_group(ranks)
                if me in ranks:
                    found[role] = group
    return found["tp"], p2d.Groups2D(row=found["row"], col=found["col"])


def _layers_1d(group: dist.ProcessGroup) -> list[nn.Module]:
    kw = {"process_group": group}
    return [
        p1d.Linear1D_Col(8, 16, **kw),  # type: ignore[arg-type]
        p1d.Linear1D_Row(16, 8, **kw),  # type: ignore[arg-type]  (bias replicated)
        p1d.FusedLinear1D_Col(8, 24, n_fused=3, **kw),  # type: ignore[arg-type]
        p1d.Embedding1D(10, 16, **kw),  # type: ignore[arg-type]
        p1d.VocabParallelEmbedding1D(10, 8, **kw),  # type: ignore[arg-type]  (padded to 64)
        p1d.VocabParallelLMHead1D(8, 10, process_group=group),
    ]


def _layers_2d(g: p2d.Groups2D) -> list[nn.Module]:
    return [
        p2d.Linear2D(8, 16, groups=g),  # stored (in/q, out/q): transposed
        p2d.LayerNorm2D(16, groups=g),
        p2d.Classifier2D(16, 5, groups=g),
        p2d.VocabParallelClassifier2D(16, 8, groups=g),
        p2d.Embedding2D(10, 16, groups=g),
        p2d.VocabParallelEmbedding2D(8, 16, groups=g),
        p2d.PatchEmbedding2D(8, 4, 3, 16, groups=g),
    ]


def _layers_2p5d(g: p2p5d.Groups2p5D) -> list[nn.Module]:
    return [
        p2p5d.Linear2p5D(8, 16, groups=g),  # stored transposed
        p2p5d.LayerNorm2p5D(16, groups=g),
        p2p5d.Classifier2p5D(16, 5, groups=g),
        p2p5d.VocabParallelClassifier2p5D(16, 8, groups=g),
        p2p5d.Embedding2p5D(10, 16, groups=g),
        p2p5d.VocabParallelEmbedding2p5D(8, 16, groups=g),
        p2p5d.PatchEmbedding2p5D(8, 4, 3, 16, groups=g),
    ]


def _layers_3d(g: p3d.Groups3D) -> list[nn.Module]:
    fc = p3d.Linear3D(8, 16, groups=g)  # stored (in/q, out/q**2): transposed
    return [
        fc,
        p3d.Linear3D(16, 8, groups=fc.output_groups),
        p3d.LayerNorm3D(16, groups=g),
        p3d.Classifier3D(16, 5, groups=g),
        p3d.VocabParallelClassifier3D(16, 8, groups=g),
        p3d.Embedding3D(10, 16, groups=g),
        p3d.VocabParallelEmbedding3D(8, 16, groups=g),
        p3d.PatchEmbedding3D(8, 4, 3, 16, groups=g),
    ]


def _check_layer(layer: nn.Module, tensor_group: dist.ProcessGroup, case: str) -> None:
    full_state: Callable[[], dict[str, torch.Tensor]] = layer.full_state  # type: ignore[assignment]
    state = full_state()  # COLLECTIVE
    params = dict(layer.named_parameters())
    assert set(params) <= set(state), f"{case}: {sorted(params)} vs {sorted(state)}"
    marked = 0
    for name, param in params.items():
        where = f"{case}.{name}"
        full = state[name]
        layout = get_shard_layout(param)
        if layout is None:  # replicated over the tensor group: the full tensor is the parameter
            assert torch.equal(full, param.detach()), where
            continue
        marked += 1
        assert tuple(layout.full_shape) == tuple(full.shape), where
        assert tuple(layout.shard_shape()) == tuple(param.shape), where
        gathered = layout.gather(param.detach())  # COLLECTIVE
        torch.testing.assert_close(gathered, full, rtol=0, atol=0, msg=where)
        torch.testing.assert_close(layout.shard(full), param.detach(), rtol=0, atol=0, msg=where)
        # replicas: each element counted once over the tensor group
        local = param.detach().double().pow(2).sum() / layout.replicas
        dist.all_reduce(local, group=tensor_group)
        torch.testing.assert_close(local, full.double().pow(2).sum(), rtol=1e-12, atol=0, msg=where)
    assert marked, f"{case}: no parameter carries a shard layout"


def _check_norm(layers: list[nn.Module], tensor_group: dist.ProcessGroup, case: str) -> None:
    """The legacy engine's gradient norm over the tensor group (shares from ``replicas``) of the
    parameters used as gradients equals the dense norm of the full tensors."""
    pairs = [(p.detach().clone(), p) for layer in layers for p in layer.parameters()]
    dense = [
        full
        for layer in layers
        for name, full in layer.full_state().items()  # type: ignore[operator]
        if name in dict(layer.named_parameters())
    ]
    norm_fn = ModelParallelGradNorm(tensor_group, None)
    for norm_type in (2.0, math.inf):
        got = norm_fn(pairs, norm_type)
        want = torch.linalg.vector_norm(torch.cat([t.flatten() for t in dense]), norm_type)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=0, msg=case)


def _run(rank: int, world_size: int, port: int) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, seed=7, verbose=False)
    tp_1d, grid = _blocks()
    groups_2p5d = p2p5d.new_groups_2p5d(depth=2)
    groups_3d = p3d.build_groups_3d()
    modes = {
        "1d": (_layers_1d(tp_1d), tp_1d),
        "2d": (_layers_2d(grid), tp_1d),  # the grid spans the same block of 4 ranks
        "2.5d": (_layers_2p5d(groups_2p5d), groups_2p5d.tensor),
        "3d": (_layers_3d(groups_3d), groups_3d.tensor),
    }
    for mode, (layers, tensor_group) in modes.items():
        for layer in layers:
            _check_layer(layer, tensor_group, f"{mode} {type(layer).__name__}")
        _check_norm(layers, tensor_group, mode)


def test_every_mode_satisfies_the_shard_layout_contract() -> None:
    spawn(_run, 8)
