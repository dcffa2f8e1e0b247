"""DistributedLamb and DistributedAdaFactor on 2 ranks equal their unsharded runs.

Recipe (as Colossal-AI's ``tests/test_optimizer/test_dist_lamb.py``, "test without forward"):
every rank builds the same tiny model and steps an unsharded reference optimizer on the full
gradients of a full batch; the distributed optimizer steps this rank's shards of the same
parameters with the matching slices of those gradients, either

* **ZeRO**: each parameter flattened, zero-padded to a multiple of 2 and cut in two flat shards
  (``shard_to_working_param`` maps each shard to its parameter; shapes are chosen so shards cut
  rows in the middle and padding occurs), or
* **tensor parallelism**: column-parallel (split dim 0), row-parallel (split dim 1) and
  replicated parameters, marked with a ``TPShardSpec``.

After 4 steps the gathered shards equal the reference parameters within fp32 tolerances
(``rtol=1e-5, atol=1e-6``: only summation orders differ), and the parameters moved by more than
1e-3 (≫ the tolerance). DistributedAdaFactor's reference is Hugging Face's Adafactor when
transformers is installed (the unsharded DistributedAdaFactor otherwise).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from kolossos.nn.layer.parallel_1d.sharding import TPShardSpec, set_tp_spec
from kolossos.nn.optimizer import DistributedAdaFactor, DistributedLamb, Lamb
from kolossos.testing import distributed

RTOL, ATOL = 1e-5, 1e-6
MOVED = 1e-3
STEPS = 4
OptFactory = Callable[[list[dict[str, object]]], torch.optim.Optimizer]


class Tiny(nn.Module):
    """Shapes that make ZeRO shards cut rows (7x5 = 35 elements, padded to 36) and a 3D weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(5, 8)
        self.fc1 = nn.Linear(8, 5)
        self.fc2 = nn.Linear(5, 7)
        self.cube = nn.Parameter(torch.randn(3, 2, 4))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc0(x))
        h = torch.tanh(self.fc1(h))
        cube = (torch.tanh(self.cube) * x[:, None, None, :4]).pow(2).sum((1, 2, 3))
        return self.fc2(h).sum(-1) + cube


#: tensor-parallel plan: parameter name -> split dimension (absent: replicated)
TP_PLAN = {"fc0.weight": 0, "fc0.bias": 0, "fc1.weight": 1, "cube": 2}


def _groups(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, object]]:
    """Two groups, weight decay on weights only (as upstream's tests)."""
    decay = [p for n, p in named if not n.endswith("bias")]
    rest = [p for n, p in named if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _full_grads(model: nn.Module, step: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 5, generator=gen)
    model.zero_grad()
    model(x).pow(2).mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


def _zero_shard(t: Tensor, rank: int, world: int) -> Tensor:
    flat = t.detach().reshape(-1)
    size = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
    return padded[rank * size : (rank + 1) * size].clone()


def _tp_shard(name: str, t: Tensor, rank: int, world: int) -> Tensor:
    dim = TP_PLAN.get(name)
    return t.detach().clone() if dim is None else t.detach().chunk(world, dim)[rank].clone()


def _gather(shard: Tensor, full: Tensor, mode: str, dim: int | None) -> Tensor:
    world = dist.get_world_size()
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.detach().contiguous())
    if mode == "zero":
        return torch.cat(parts)[: full.numel()].reshape(full.shape)
    return shard.detach() if dim is None else torch.cat(parts, dim)


def run_parity(mode: str, make_ref: OptFactory, make_dist: OptFactory, zero_kw: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    world_group = dist.group.WORLD
    assert world_group is not None
    torch.manual_seed(0)
    ref_model = Tiny()
    start = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    shards: dict[str, nn.Parameter] = {}
    working: dict[int, Tensor] = {}
    for n, p in ref_model.named_parameters():
        if mode == "zero":
            shards[n] = nn.Parameter(_zero_shard(p, rank, world))
            working[id(shards[n])] = p
        else:
            shards[n] = nn.Parameter(_tp_shard(n, p, rank, world))
            if n in TP_PLAN:
                spec = TPShardSpec(dim=TP_PLAN[n], full_shape=tuple(p.shape), group=world_group)
                set_tp_spec(shards[n], spec)
    ref_opt = make_ref(_groups(list(ref_model.named_parameters())))
    opt = make_dist(_groups(list(shards.items())))
    if mode == "zero":
        opt.setup_distributed(None, world_group, working, None, **{zero_kw: True})  # type: ignore[attr-defined]
    else:
        opt.setup_distributed(world_group)  # type: ignore[attr-defined]
    for step in range(STEPS):
        grads = _full_grads(ref_model, step)
        for n, shard in shards.items():
            g = grads[n]
            shard.grad = (
                _zero_shard(g, rank, world) if mode == "zero" else _tp_shard(n, g, rank, world)
            )
        ref_opt.step()
        opt.step()
    for n, p in ref_model.named_parameters():
        got = _gather(shards[n], p, mode, TP_PLAN.get(n))
        torch.testing.assert_close(got, p.detach(), rtol=RTOL, atol=ATOL, msg=f"{mode} {n}")
        assert (p.detach() - start[n]).abs().max() > MOVED, f"{n} barely moved"


def _lamb(groups: list[dict[str, object]]) -> torch.optim.Optimizer:
    return Lamb(groups, lr=2e-2, eps=1e-6)


def _dist_lamb(groups: list[dict[str, object]]) -> torch.optim.Optimizer:
    return DistributedLamb(groups, lr=2e-2, eps=1e-6)


ADAFACTOR_OPTIONS = [
    {},
    {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "scale_parameter": False},
]


def _hf_or_own(**kw: object) -> OptFactory:
    try:
        from transformers.optimization import Adafactor
    except ImportError:  # the unsharded DistributedAdaFactor is the same algorithm
        return lambda groups: DistributedAdaFactor(groups, **kw)  # type: ignore[arg-type]
    return lambda groups: Adafactor(groups, **kw)


@pytest.mark.parametrize("mode", ["zero", "tp"])
@distributed(2)
def test_distributed_lamb_matches_lamb(mode: str) -> None:
    run_parity(mode, _lamb, _dist_lamb, "is_zero")


@pytest.mark.parametrize("mode", ["zero", "tp"])
@distributed(2)
def test_distributed_adafactor_matches_adafactor(mode: str) -> None:
    for kw in ADAFACTOR_OPTIONS:
        run_parity(
            mode,
            _hf_or_own(**kw),
            lambda groups, kw=kw: DistributedAdaFactor(groups, **kw),  # type: ignore[misc]
            "use_zero",
        )


@distributed(2)
def test_device_mesh_process_groups() -> None:
    from kolossos.cluster import DeviceMeshInfo, DeviceMeshManager
    from kolossos.device.device_mesh import DeviceMesh

    rank = dist.get_rank()
    manager = DeviceMeshManager()
    mesh = manager.create_device_mesh("1x2", DeviceMeshInfo(physical_ids=[0, 1], mesh_shape=(1, 2)))
    assert mesh.is_initialized and mesh.shape == (1, 2)
    assert mesh.get_ranks_in_process_group(axis=1) == [0, 1]
    assert mesh.get_ranks_in_process_group(axis=0) == [rank]
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_process_group(axis=1))
    assert t.item() == 2
    copied = copy.deepcopy(mesh)
    assert copied.get_process_group(1) is mesh.get_process_group(1)
    from_pg = DeviceMesh.from_process_group(mesh.get_process_group(1))
    assert from_pg.shape == [2] and from_pg.logical_mesh_id is None and from_pg.num_devices == 2
    assert from_pg.get_ranks_in_process_group(0) == [0, 1]
    with pytest.raises(RuntimeError, match="from_process_group"):
        from_pg.get_ranks_in_process_group(0, global_rank=1)
    manager.destroy_all()
    assert manager.device_mesh_store == {}
