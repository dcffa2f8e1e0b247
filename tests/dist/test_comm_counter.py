"""CommCounter on real process groups: exact byte counts per collective kind and group, DDP's
traffic (its reducer bypasses the Python API), DTensor redistributions, and gloo's real traffic
measured with WireMeter against the modelled bytes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from kolossos.testing import distributed
from kolossos.utils.profiling import CommCounter, WireMeter, comm_bytes_per_rank

F32 = 4


def _quiet() -> None:
    warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor & co. are "deprecated"


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_collective_bytes_are_exact(world_size: int) -> None:
    _quiet()
    n, rank = world_size, dist.get_rank()
    numel = 12 * 1024
    world = dist.group.WORLD
    assert world is not None
    with CommCounter() as comm:
        t = torch.ones(numel)
        dist.all_reduce(t)
        dist.reduce_scatter_tensor(torch.empty(numel // n), t)
        dist.all_gather_into_tensor(torch.empty(numel * n), t)
        dist.broadcast(t, src=0)
        dist.all_to_all_single(torch.empty(numel), t)
        dist.barrier()
        if rank == 0:
            dist.send(torch.ones(10), dst=1)
        elif rank == 1:
            dist.recv(torch.empty(10), src=0)
        funcol.all_reduce(torch.ones(100), "sum", world).wait()
    nbytes = numel * F32
    assert comm.bytes("all_reduce") == nbytes + 100 * F32
    assert comm.calls("all_reduce") == 2
    assert comm.bytes("reduce_scatter") == nbytes  # the whole input
    assert comm.bytes("all_gather") == nbytes * n  # the gathered output
    assert comm.bytes("broadcast") == comm.bytes("all_to_all") == nbytes
    assert comm.calls("barrier") == 1 and comm.bytes("barrier") == 0
    assert comm.bytes("send") == (40 if rank == 0 else 0)
    assert comm.bytes("recv") == (40 if rank == 1 else 0)
    assert set(comm.as_dict()) == {"world"}
    # the modelled bytes sent: ring all-reduce 2(N-1)/N, gloo's reduce-scatter as much
    ring = (n - 1) / n
    assert comm.sent_bytes("all_reduce") == pytest.approx(2 * ring * (nbytes + 400))
    assert comm.sent_bytes("reduce_scatter") == pytest.approx(2 * ring * nbytes)
    assert comm.sent_bytes("all_gather") == pytest.approx(ring * nbytes * n)
    comm.reset()
    assert comm.calls() == 0


@distributed(4)
def test_groups_are_counted_apart_and_nothing_outside_the_block() -> None:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    dist.all_reduce(torch.ones(5))  # before the block: not counted
    with CommCounter() as comm:
        dist.all_reduce(torch.ones(8), group=mine)
        dist.all_reduce(torch.ones(16))
    label = "ranks=0,1" if rank < 2 else "ranks=2,3"
    assert comm.bytes(group=label) == 32 and comm.bytes(group="world") == 64
    assert comm.stats[("all_reduce", label)].group_size == 2
    assert comm.stats[("all_reduce", "world")].backend == "gloo"
    dist.all_reduce(torch.ones(5))  # after it: not counted either
    assert comm.calls() == 2
    assert "ranks=" in comm.summary() and "world" in comm.summary()


@distributed(2)
def test_dtensor_redistributions_are_counted() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    with CommCounter() as comm:
        product = a @ b  # b is gathered for the matmul ...
        assert isinstance(product, DTensor)
        product.full_tensor()  # ... then the result
    assert comm.calls("all_gather") == 2
    assert comm.bytes("all_gather") == 2 * 8 * 8 * F32


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_ddp_traffic_is_two_psi_per_step(world_size: int) -> None:
    """DDP all-reduces every gradient once per step: 2Ψ(N-1)/N elements sent per rank (ring)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp())
    psi = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, 512)
    model(x).sum().backward()  # first step: DDP's lazy set-up traffic stays out of the count
    steps = 3
    with CommCounter() as comm, WireMeter() as wire:
        for _ in range(steps):
            model(x).sum().backward()
    formula = comm_bytes_per_rank(psi, "ddp", world_size, F32)
    assert comm.bytes("all_reduce") / steps == psi * F32  # every gradient byte, exactly once
    assert comm.sent_bytes() / steps == pytest.approx(formula, rel=0.05)
    if wire.bytes is not None:  # what gloo really wrote to its sockets
        assert wire.bytes / steps == pytest.approx(formula, rel=0.05)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_gloo_wire_bytes_match_the_model(world_size: int) -> None:
    """WireMeter's measured bytes agree with the gloo model (reduce-scatter costs an all-reduce)."""
    _quiet()
    if not WireMeter.available():
        pytest.skip("/proc/self/io is not readable here")
    n, numel = world_size, 3 * 2**18
    t = torch.ones(numel)
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(numel // n), t),
        "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(numel), t[: numel // n]),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty(numel), t),
    }
    for kind, call in calls.items():
        call()  # warm the connection
        with CommCounter("gloo") as comm, WireMeter() as wire:
            call()
        assert wire.bytes == pytest.approx(comm.sent_bytes(kind), rel=0.05), kind
