"""The pipeline's point-to-point layer and executor on gloo: shapes negotiated once, fixed
shapes, and no deadlock whatever the order of the actions (every schedule, odd micro-batch
counts, and random valid orders that receive messages out of their send order)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.cluster import ProcessGroupMesh
from kolossos.pipeline import (
    PipelineP2P,
    PipelineSharedModuleWrapper,
    PipelineStageManager,
    build_pipeline_model,
)
from kolossos.pipeline.schedule import PipelineSchedule, ScheduleTable, create_schedule
from kolossos.pipeline.schedule.zero_bubble import list_schedule
from kolossos.pipeline.simulate import simulate
from kolossos.testing import distributed, parameterize


@distributed(2, timeout=120)
def test_metadata_is_negotiated_once_and_cached() -> None:
    rank = dist.get_rank()

    @parameterize("cache", [True, False])
    def case(cache: bool) -> None:
        p2p = PipelineP2P(None, enable_metadata_cache=cache)
        for step in range(3):
            if rank == 0:
                h = torch.full((2, 3), float(step), requires_grad=True)
                mask = torch.arange(4)
                p2p.send_activation(1, ("act", 1), [h * 2, mask], is_tuple=True)
            else:
                (h, mask), is_tuple = p2p.recv_activation(0, ("act", 1))
                assert is_tuple and h.requires_grad and not mask.requires_grad
                assert h.dtype == torch.float32 and mask.dtype == torch.int64
                assert torch.equal(h, torch.full((2, 3), 2.0 * step)) and mask.tolist() == [
                    0,
                    1,
                    2,
                    3,
                ]
        p2p.wait_sends()
        count = p2p.stats.metadata_sent if rank == 0 else p2p.stats.metadata_received
        assert count == (1 if cache else 3)

    case()


@distributed(2, timeout=120)
def test_fixed_tensor_shape_and_simultaneous_sends() -> None:
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    p2p = PipelineP2P(None, tensor_shape=(2, 4))
    if rank == 0:
        with pytest.raises(ValueError, match="TENSOR_SHAPE"):  # refused before any traffic
            p2p.send_activation(1, "s", [torch.ones(3, 4)], is_tuple=False)
    # both ranks send before they receive: sends never block
    p2p.send_activation(peer, "s", [torch.full((2, 4), float(rank))], is_tuple=False)
    p2p.send_grad(peer, [torch.full((2, 4), 10.0 + rank)])
    (got,), is_tuple = p2p.recv_activation(peer, "s")
    (grad,) = p2p.recv_grad(peer, [p2p.fixed[0][0]])  # type: ignore[index]
    p2p.wait_sends()
    assert not is_tuple and torch.equal(got, torch.full((2, 4), float(peer)))
    assert torch.equal(grad, torch.full((2, 4), 10.0 + peer))
    assert p2p.stats.metadata_sent == p2p.stats.metadata_received == 0


def out_of_order(table: ScheduleTable) -> int:
    """Rank pairs whose receiver consumes messages in another order than they were sent."""
    count = 0
    for src in range(table.pp_size):
        for dst in set(range(table.pp_size)) - {src}:
            consumed = [
                msg
                for a in table.ranks[dst]
                if (msg := table.needs(dst, a)) is not None
                and table.owner_of(msg.stage - 1 if msg.kind == "act" else msg.stage + 1)[0] == src
            ]
            count += consumed != table.messages(src, dst)
    return count


class FixedTable(PipelineSchedule):
    """Runs a given table (to test the executor on arbitrary valid orders)."""

    def __init__(self, sm: PipelineStageManager, table: ScheduleTable) -> None:
        self.layout = table.layout  # type: ignore[misc]
        super().__init__(sm, num_microbatches=table.num_microbatches)
        self.fixed_table = table

    def build_table(self, num_microbatches: int) -> ScheduleTable:
        return self.fixed_table


def stack(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)))


def run(
    sm: PipelineStageManager, runner: PipelineSchedule, x: torch.Tensor, y: torch.Tensor
) -> Any:
    """One step; the loss (broadcast from the last stage) and this rank's gradients."""
    chunks = build_pipeline_model(stack(8), sm.num_model_chunks, stage_manager=sm)
    out = runner.forward_backward_step(chunks, iter([(x, y)]), F.mse_loss)
    owner = sm.global_rank(sm.owner(sm.num_virtual_stages - 1)[0])
    loss = out["loss"].reshape(1) if out["loss"] is not None else torch.zeros(1)
    dist.broadcast(loss, src=owner, group=sm.group)
    mods = chunks if isinstance(chunks, nn.ModuleList) else [chunks]
    return loss.item(), {n: p.grad for c in mods for n, p in c.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
@distributed(timeout=120)
def test_every_order_completes_with_the_same_result(world_size: int) -> None:
    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 8, generator=gen), torch.randn(12, 8, generator=gen)
    ref = stack(8)
    F.mse_loss(ref(x), y).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}

    def check(result: Any) -> None:
        loss, grads = result
        assert loss == pytest.approx(F.mse_loss(copy.deepcopy(ref)(x), y).item(), rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-6)

    @parameterize("name", ["gpipe", "1f1b", "interleaved", "zbh1", "zbv"])
    @parameterize("m", [1, 3, 4, 12])
    def schedules(name: str, m: int) -> None:
        chunks = 2 if name in ("interleaved", "zbv") else 1
        if name == "interleaved" and m % world_size:
            return
        sm = PipelineStageManager(mesh, "pp", num_model_chunks=chunks,
                                  layout="v" if name == "zbv" else "loop")  # fmt: skip
        check(run(sm, create_schedule(name, sm, num_microbatches=m), x, y))

    @parameterize("seed", range(4))
    @parameterize("layout", ["loop", "v"])
    def random_orders(seed: int, layout: str) -> None:
        def key(a: Any, s: int) -> tuple[float]:  # a random but fixed priority per action
            return (random.Random(f"{seed}/{a}/{s}").random(),)

        table = list_schedule(
            name="random", pp_size=world_size, num_chunks=2, num_microbatches=4, layout=layout,
            memory_limit=[8] * world_size, priority=key,
        )  # fmt: skip
        simulate(table)
        reordered.append(out_of_order(table))
        sm = PipelineStageManager(mesh, "pp", num_model_chunks=2, layout=layout)
        check(run(sm, FixedTable(sm, table), x, y))

    reordered: list[int] = []
    schedules()
    random_orders()
    assert sum(reordered) > 0  # some tables consumed messages out of their send order
    if world_size == 4:
        two_pipelines(x, y, check)


def two_pipelines(x: torch.Tensor, y: torch.Tensor, check: Any) -> None:
    """A (dp=2, pp=2) mesh: two pipelines side by side, each on its own ranks, with a shared
    parameter wrapper per pipeline."""
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "pp"))
    sm = PipelineStageManager(mesh, "pp")
    assert sm.ranks == [2 * mesh.coordinate("dp"), 2 * mesh.coordinate("dp") + 1]
    wrapper = PipelineSharedModuleWrapper([0, 1], stage_manager=sm)
    assert wrapper.ranks == sm.ranks
    shared = nn.Parameter(torch.full((3,), float(dist.get_rank())))
    wrapper.register_parameter(shared)  # takes the first position's value
    assert torch.equal(shared, torch.full((3,), float(sm.ranks[0])))
    for name in ("1f1b", "zbh1"):
        check(run(sm, create_schedule(name, sm, num_microbatches=4), x, y))


@distributed(2, timeout=120)
def test_backward_goes_through_the_optimizer_wrapper() -> None:
    """1F1B routes its backward through ``optimizer.backward`` / ``backward_by_grad`` (loss
    scaling here); the split schedules refuse an optimizer that rewrites them, before any
    communication, and accept a plain wrapper."""
    from kolossos.interface import OptimizerWrapper

    class Doubling(OptimizerWrapper):
        calls: list[str] = []  # noqa: RUF012

        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self.calls.append("loss")
            (2 * loss).backward()

        def backward_by_grad(self, tensor: Any, grad: Any) -> None:
            self.calls.append("grad")
            torch.autograd.backward(tensor, grad)

    mesh = ProcessGroupMesh(2, axis_names=("pp",))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    sm = PipelineStageManager(mesh, "pp")
    chunk = build_pipeline_model(stack(8), stage_manager=sm)
    opt = Doubling(torch.optim.SGD(chunk.parameters(), lr=0.1))
    create_schedule("1f1b", sm, num_microbatches=2).forward_backward_step(
        chunk, iter([(x, y)]), F.mse_loss, optimizer=opt
    )
    assert opt.calls == (["grad"] * 2 if sm.stage == 0 else ["loss"] * 2)
    ref = stack(8)
    (2 * F.mse_loss(ref(x), y)).backward()
    expected = dict(ref.named_parameters())
    for name, p in chunk.named_parameters():  # the doubled loss reached every stage
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-5, atol=1e-6)
    zb = PipelineStageManager(mesh, "pp", num_model_chunks=2, layout="v")
    chunks = build_pipeline_model(stack(8), 2, stage_manager=zb)
    with pytest.raises(NotImplementedError, match=r"Doubling\.backward"):
        create_schedule("zbv", zb, num_microbatches=2).forward_backward_step(
            chunks, iter([(x, y)]), F.mse_loss, optimizer=opt
        )
    plain = OptimizerWrapper(torch.optim.SGD(chunks.parameters(), lr=0.1))
    create_schedule("zbv", zb, num_microbatches=2).forward_backward_step(
        chunks, iter([(x, y)]), F.mse_loss, optimizer=plain
    )
