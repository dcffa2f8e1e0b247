"""``kolossos.tensor`` on 4 CPU ranks (one spawned job each): every conversion between all
sharding specs of a 3-d tensor on a 2 x 2 mesh is exact with its gradient; the ColoTensor API
(``ProcessGroup`` layout, ``from_torch_tensor``, ``to_replicate``, ``set_dist_spec`` recorded by
autograd, ``ColoParameter`` in ``parameters()``, the compute-spec output rule) behaves as the
docs say.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from kolossos.device.device_mesh import DeviceMesh
from kolossos.tensor import (
    ColoParameter,
    ColoTensor,
    ColoTensorSpec,
    ComputePattern,
    ComputeSpec,
    ProcessGroup,
    ReplicaSpec,
    ShardSpec,
)
from kolossos.tensor.d_tensor import (
    Layout,
    LayoutConverter,
    ShardingSpec,
    compute_global_numel,
    distribute_tensor,
    get_device_mesh,
    get_sharding_spec,
    is_distributed_tensor,
    redistribute,
    shard_colwise,
    shard_rowwise,
    sharded_tensor_to_param,
    to_global,
)
from kolossos.testing import distributed

pytestmark = pytest.mark.dist


def all_specs(ndim: int, mesh_ndim: int) -> list[ShardingSpec]:
    """Every spec of an ``ndim``-d tensor on a mesh (each axis used at most once, a
    dimension's axes increasing)."""
    specs = set()
    for assign in itertools.product(range(ndim + 1), repeat=mesh_ndim):
        parts: dict[int, list[int]] = {}
        for axis, dim in enumerate(assign):
            if dim < ndim:
                parts.setdefault(dim, []).append(axis)
        specs.add(ShardingSpec(ndim, parts))
    return sorted(specs, key=str)


def expected_local(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """This rank's piece of ``full`` under ``layout``, computed by slicing (no communication)."""
    coord = layout.device_mesh.global_rank_to_local_rank(rank)
    assert isinstance(coord, list)
    shape = tuple(layout.device_mesh.shape)
    out = full
    for dim, axes in layout.sharding_spec.dim_partition_dict.items():
        index, pieces = 0, 1
        for axis in axes:  # outer axis first
            index = index * shape[axis] + coord[axis]
            pieces *= shape[axis]
        out = out.chunk(pieces, dim=dim)[index]
    return out


@distributed(4)
def test_every_conversion_on_a_2x2_mesh_is_exact_with_its_gradient() -> None:
    rank = dist.get_rank()
    mesh = DeviceMesh(torch.arange(4), (2, 2), device="cpu")
    converter = LayoutConverter()
    full = torch.arange(64, dtype=torch.float32).reshape(4, 4, 4)
    weight = torch.randn(4, 4, 4, generator=torch.Generator().manual_seed(7))
    specs = all_specs(3, 2)
    assert len(specs) == 16
    for src_spec, dst_spec in itertools.product(specs, specs):
        src = Layout(mesh, src_spec, full.shape)
        dst = Layout(mesh, dst_spec, full.shape)
        local = expected_local(full, src, rank).clone().requires_grad_(True)
        dt = DTensor.from_local(local, mesh.get_torch_mesh(), src.placements(), run_check=False)
        out = converter.apply(dt, src, dst)
        got = out.to_local()
        label = f"{src_spec} -> {dst_spec}"
        torch.testing.assert_close(got, expected_local(full, dst, rank), rtol=0, atol=0, msg=label)
        # d(sum(out * weight)) / d(local) is this rank's piece of weight in the source layout
        (got * expected_local(weight, dst, rank)).sum().backward()
        assert local.grad is not None, label
        torch.testing.assert_close(local.grad, expected_local(weight, src, rank), rtol=0, atol=0)


@distributed(4)
def test_d_tensor_api_round_trip() -> None:
    rank = dist.get_rank()
    mesh = DeviceMesh(torch.arange(4), (2, 2), device="cpu")
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4).requires_grad_(True)
    spec = ShardingSpec.from_notation("S01R")
    t = distribute_tensor(full, mesh, spec)
    assert is_distributed_tensor(t) and not is_distributed_tensor(full)
    assert get_sharding_spec(t) == spec and get_device_mesh(t) is mesh
    assert t.shape == (8, 4) and t.to_local().shape == (2, 4)
    torch.testing.assert_close(t.to_local(), full.detach()[2 * rank : 2 * rank + 2])
    moved = redistribute(t, mesh, ShardingSpec.from_notation("RS01"))
    assert get_sharding_spec(moved) == ShardingSpec.from_notation("RS01")
    torch.testing.assert_close(moved.to_local(), full.detach()[:, rank : rank + 1])
    torch.testing.assert_close(to_global(moved), full.detach())
    assert moved is t  # a leaf is redistributed in place, as in Colossal-AI
    assert compute_global_numel(t) == 32
    rows = shard_rowwise(full.detach())  # the world as a 1-d mesh
    assert rows.to_local().shape == (2, 4) and get_sharding_spec(rows) == ShardingSpec(2, {0: [0]})
    cols = shard_colwise(full.detach(), dist.group.WORLD)
    torch.testing.assert_close(cols.to_local(), full.detach()[:, rank : rank + 1])
    param = sharded_tensor_to_param(cols)
    assert isinstance(param, nn.Parameter) and is_distributed_tensor(param)
    assert get_sharding_spec(param) == get_sharding_spec(cols)
    layer = nn.Linear(4, 8, bias=False)
    layer.weight = param
    assert next(layer.parameters()) is param


@distributed(4)
def test_process_group_layout_and_resharding_demo() -> None:
    rank = dist.get_rank()
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    assert pg.tp_world_size() == 2 and pg.dp_world_size() == 2
    assert pg.tp_rank_list() == [rank - rank % 2, rank - rank % 2 + 1]  # tp on the low axis
    assert pg.dp_rank_list() == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(pg.tp_process_group()) == pg.tp_rank_list()
    torch.manual_seed(0)
    local = torch.randn(2, 3, 1)
    spec = ColoTensorSpec(
        pg, ShardSpec(dims=[-1], num_partitions=[2]), ComputeSpec(ComputePattern.TP1D)
    )
    t1 = ColoTensor.from_torch_tensor(local, spec)
    assert t1.shape == (2, 3, 2) and t1.size_local() == (2, 3, 1)
    assert t1.dist_spec == ShardSpec([2], [2]) and t1.is_shard_1dcol()
    t1 = t1.to_replicate()
    assert isinstance(t1, ColoTensor) and t1.is_replicate() and t1.size_local() == (2, 3, 2)
    assert t1.dist_spec == ReplicaSpec()
    torch.testing.assert_close(t1.to_local(), torch.cat([local, local], dim=-1))
    t1.set_dist_spec(ShardSpec([0], [pg.tp_world_size()]))
    assert t1.size_local() == (1, 3, 2) and t1.is_shard_1drow()
    piece = torch.cat([local, local], dim=-1)[pg.tp_local_rank() : pg.tp_local_rank() + 1]
    torch.testing.assert_close(t1.to_local(), piece)


@distributed(4)
def test_set_dist_spec_is_recorded_by_autograd() -> None:
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    tp = pg.tp_local_rank()
    full = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    weight = full + 100
    local = full[:, 2 * tp : 2 * tp + 2].clone().requires_grad_(True)
    t = ColoTensor.from_torch_tensor(local, ColoTensorSpec(pg, ShardSpec([-1], [2])))
    assert not t.is_leaf  # from_torch_tensor is differentiable
    t.set_dist_spec(ShardSpec([0], [2]))  # in place, recorded by autograd
    assert t.placements == (Shard(0),)
    torch.testing.assert_close(t.to_local(), full[2 * tp : 2 * tp + 2])
    (t.to_local() * weight[2 * tp : 2 * tp + 2]).sum().backward()
    # the backward converted the gradient back to the column split
    torch.testing.assert_close(local.grad, weight[:, 2 * tp : 2 * tp + 2])
    # out of place: to_replicate is differentiable too
    local.grad = None
    t2 = ColoTensor.from_torch_tensor(local, ColoTensorSpec(pg, ShardSpec([-1], [2])))
    (t2.to_replicate().to_local() * weight).sum().backward()
    torch.testing.assert_close(local.grad, weight[:, 2 * tp : 2 * tp + 2])


@distributed(4)
def test_colo_parameters_train_a_tensor_parallel_linear() -> None:
    """A column-split then row-split MLP of ColoParameters matches the dense one (loss and
    updated weights), and the parameters are visible to ``parameters()`` and the optimizer."""
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ref = [p.detach().clone() for p in dense.parameters()]
    tp_model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    tp_model.load_state_dict(dense.state_dict())
    rules = {"0.weight": [0], "0.bias": [0], "2.weight": [-1], "2.bias": None}
    for name, param in list(tp_model.named_parameters()):
        module = tp_model.get_submodule(name.rsplit(".", 1)[0])
        colo = ColoParameter(param.detach().clone(), spec=ColoTensorSpec(pg))
        dims = rules[name]
        if dims is not None:
            colo.set_tensor_spec(ShardSpec(dims, [2]), ComputeSpec(ComputePattern.TP1D))
            if name.startswith("0."):
                colo.compute_spec.set_output_replicate(False)  # type: ignore[union-attr]
        setattr(module, name.rsplit(".", 1)[1], colo)
    params = list(tp_model.parameters())
    assert len(params) == 4 and all(isinstance(p, ColoParameter) for p in params)
    assert params[0].size_local() == (8, 8) and params[2].size_local() == (8, 8)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    opt = torch.optim.SGD(tp_model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=0.5)
    for _ in range(3):
        out = tp_model(x)
        assert isinstance(out, DTensor) and out.placements[0].is_replicate()
        loss = out.to_local().pow(2).mean()
        ref_loss = dense(x).pow(2).mean()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        assert params[0].grad is not None and params[0].grad.placements == params[0].placements
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for colo, dense_p, start in zip(tp_model.parameters(), dense.parameters(), ref, strict=True):
        full = colo.full_tensor()
        torch.testing.assert_close(full, dense_p.detach(), rtol=1e-5, atol=1e-6)
        assert (full - start).abs().max() > 1e-3  # it moved far beyond the tolerance


@distributed(4)
def test_gemini_takes_colo_parameters() -> None:
    """GeminiDDP keeps the pieces of tensor-parallel ColoParameters (reads give ColoTensor views,
    chunks over the ProcessGroup's dp group), unwraps one-rank ones, rejects bare DTensors."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from kolossos.utils.model.colo_init_context import ColoInitContext
    from kolossos.zero import GeminiDDP

    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    with ColoInitContext(device="cpu", default_pg=pg):
        model = nn.Linear(8, 8)
    model.weight.set_dist_spec(ShardSpec([0], [2]))
    with pytest.raises(ValueError, match="dp group"):  # not over the tp pieces' world
        GeminiDDP(copy.deepcopy(model), process_group=dist.group.WORLD)
    wrapped = GeminiDDP(model, placement_policy="cpu", mixed_precision=torch.float32)
    assert dist.get_process_group_ranks(wrapped.process_group) == pg.dp_rank_list()
    assert not any(isinstance(p, DTensor) for p in wrapped.module.parameters())
    pieces = dict(wrapped.named_full_tensors())  # Gemini's full tensors are the tp pieces
    assert pieces["weight"].shape == (4, 8) and pieces["bias"].shape == (8,)
    out = wrapped(torch.ones(2, 8))
    assert out.shape == (2, 8)

    with ColoInitContext(device="cpu", default_pg=ProcessGroup(tp_degree=1)):
        model = nn.Linear(8, 8)
    assert isinstance(model.weight, ColoParameter)
    wrapped = GeminiDDP(model, placement_policy="cpu", mixed_precision=torch.float32)
    assert not any(isinstance(p, DTensor) for p in wrapped.module.parameters())

    bare = nn.Linear(8, 8)
    bare.weight = nn.Parameter(distribute_tensor(bare.weight.detach(), pg.tp_mesh, [Replicate()]))
    with pytest.raises(NotImplementedError, match="without a kolossos ProcessGroup"):
        GeminiDDP(bare, placement_policy="cpu", mixed_precision=torch.float32)
