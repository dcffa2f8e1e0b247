"""Colossal-AI's pipeline point-to-point API on gloo: ``PipelineP2PCommunication`` sends tensors
and picklable objects forward and backward, with and without metadata, one-way and both ways
(upstream's test, rewritten by the import), and the stage manager's neighbour and stage groups
on a 2-rank and a 4-rank job (upstream's stage-manager test)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kolossos.accelerator import get_accelerator
from kolossos.cluster import ProcessGroupMesh
from kolossos.pipeline.p2p import PipelineP2PCommunication, create_send_metadata
from kolossos.pipeline.stage_manager import PipelineStageManager
from kolossos.testing import distributed


def same(a: Any, b: Any) -> bool:
    """Structural equality with exact tensor comparison."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@distributed(2, timeout=120)
def test_upstream_p2p_communication() -> None:
    """Upstream's ``test_p2p_communication`` (objects, fallbacks, and tensors without
    metadata), then the stage manager's answers on a 2-stage pipeline."""
    sm = PipelineStageManager(ProcessGroupMesh(2), 0)
    p2p = PipelineP2PCommunication(sm)
    rank = dist.get_rank()
    tensor = torch.ones(1, device=get_accelerator().get_current_device())
    data = ["tensor", tensor, [tensor], {"tensor": tensor}]
    if rank == 0:
        for obj in data:
            p2p.send_forward(obj)
        for i in range(len(data)):
            recv = p2p.send_forward_recv_backward(data[i], send_prior_fallback=False)
            assert recv == data[-(i + 1)]
    else:
        for obj in data:
            assert p2p.recv_forward() == obj
        for i in range(len(data)):
            p2p.send_backward(data[-(i + 1)])
            assert p2p.recv_forward() == data[i]
    if rank == 1:
        for obj in data:
            p2p.send_backward(obj)
        for i in range(len(data)):
            recv = p2p.send_backward_recv_forward(data[i], send_prior_fallback=True)
            assert recv == data[-(i + 1)]
    else:
        for obj in data:
            assert p2p.recv_backward() == obj
        for i in range(len(data)):
            recv = p2p.recv_backward()
            p2p.send_forward(data[-(i + 1)])
            assert recv == data[i]
    if rank == 0:
        recv = p2p.send_forward_recv_backward(
            tensor, send_metadata=False, metadata_recv=create_send_metadata(tensor)
        )
        assert recv == tensor
    else:
        assert p2p.recv_forward(metadata_recv=create_send_metadata(tensor)) == tensor
        p2p.send_backward(tensor, send_metadata=False)
    # the stage manager of a 2-stage pipeline
    assert sm.num_stages == 2 and sm.stage == rank and sm.get_rank() == rank
    assert sm.get_prev_rank() == sm.get_next_rank() == 1 - rank
    assert sm.is_first_stage() == (rank == 0) and sm.is_last_stage() == (rank == 1)
    dist.barrier(group=sm.get_p2p_process_group(1, 0))
    assert sm.init_process_group_by_stages([1, 0]) is sm.group


@distributed(2, timeout=120)
def test_objects_both_ways_keep_structure_dtype_and_gradient_flags() -> None:
    sm = PipelineStageManager(ProcessGroupMesh(2, axis_names=("pp",)), "pp")
    p2p = PipelineP2PCommunication(sm)
    h = torch.arange(6.0).reshape(2, 3).requires_grad_()
    hidden = {
        "hidden_states": h * 2,
        "mask": torch.tensor([[True, False]]),
        "past": (torch.zeros(1, 2, dtype=torch.bfloat16), None),
        "step": 3,
    }
    output = OrderedDict(logits=torch.full((2, 4), 0.5, dtype=torch.float64), tag="out")
    grads = [torch.ones(2, 3), torch.full((1,), 7, dtype=torch.int32)]
    if sm.is_first_stage():
        p2p.send_forward(hidden)
        p2p.send_forward(output)
        got = p2p.recv_backward()
        assert same(got, grads)
        p2p.send_forward(None)  # a None travels as an object
        # tensors only, metadata known: one batch both ways
        back = p2p.send_forward_recv_backward(
            [h.detach()], send_metadata=False, metadata_recv=create_send_metadata(grads)
        )
        assert same(back, grads)
        assert p2p.link(1).stats.metadata_sent == 3
    else:
        got = p2p.recv_forward()
        assert same(got, {**hidden, "hidden_states": (h * 2).detach()})
        assert got["hidden_states"].requires_grad and got["hidden_states"].is_leaf
        assert not got["mask"].requires_grad
        assert same(p2p.recv_forward(), output)
        p2p.send_backward(grads)
        assert p2p.recv_forward() is None
        recv = p2p.send_backward_recv_forward(
            grads,
            send_metadata=False,
            metadata_recv=create_send_metadata([h.detach()]),
        )
        assert same(recv, [h.detach()])
        assert p2p.link(0).stats.metadata_received == 3
        with pytest.raises(ValueError, match="send_prior_fallback"):
            p2p.send_backward_recv_forward(grads)  # metadata travels: the order must be given
        with pytest.raises(ValueError, match="non-tensor leaves"):
            p2p.recv_forward(metadata_recv=create_send_metadata(["tag"], strict=False))


@distributed(2, timeout=120)
def test_p2p_communicate_exchanges_tensors_between_two_stages() -> None:
    sm = PipelineStageManager(ProcessGroupMesh(2), 0)
    p2p = PipelineP2PCommunication(sm)
    rank = dist.get_rank()
    mine = torch.full((2, 3, 4), float(rank + 1))
    got = p2p.p2p_communicate(mine, recv_pre=True)
    assert got is not None and got.dtype == torch.float16
    assert torch.equal(got, torch.full((2, 3, 4), float(2 - rank), dtype=torch.float16))
    got = p2p.p2p_communicate(
        mine if rank == 0 else None, recv_pre=rank == 1, comm_dtype=mine.dtype
    )
    if rank == 0:
        assert got is None
    else:
        assert got is not None and torch.equal(got, torch.ones(2, 3, 4))
    with pytest.raises(TypeError, match="send_forward"):
        p2p.p2p_communicate([mine], recv_pre=False)


@distributed(4, timeout=120)
def test_neighbour_and_stage_groups() -> None:
    """Upstream's stage-manager test ((dp=2, pp=2), then pp=4 with a group of stages 0 and 2),
    and objects along a 4-stage chain over the two-rank groups."""
    rank = dist.get_rank()
    sm = PipelineStageManager(ProcessGroupMesh(2, 2), 1)
    pipeline = [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert sm.num_stages == 2 and sm.stage == rank % 2
    assert sm.is_first_stage() == (pipeline.index(rank) == 0)
    assert sm.get_next_rank() == sm.get_prev_rank() == pipeline[1 - pipeline.index(rank)]
    dist.barrier(group=sm.get_p2p_process_group(*pipeline))

    sm = PipelineStageManager(ProcessGroupMesh(4), 0, num_layers_per_stage=[1, 2, 3, 2])
    assert sm.distribute_layers(8) == [1, 2, 3, 2]
    with pytest.raises(ValueError, match="adds up to 8"):
        sm.distribute_layers(9)
    assert sorted(sm.p2p_groups) == [p for p in [(0, 1), (1, 2), (2, 3)] if rank in p]
    for pair in sm.p2p_groups:  # each pair group holds just its two ranks
        assert dist.get_process_group_ranks(sm.get_p2p_process_group(*pair)) == list(pair)
    with pytest.raises(ValueError, match="no point-to-point group"):
        sm.get_p2p_process_group(0, 3)  # first and last are neighbours only when interleaving
    group = sm.init_process_group_by_stages([0, 2])
    assert (group is None) == (rank in (1, 3))
    if group is not None:
        dist.barrier(group=group)
    assert sm.init_process_group_by_stages([2, 0]) is group  # cached
    # a message down the chain and its answer back up
    p2p = PipelineP2PCommunication(sm)
    value: dict[str, Any] = {"hops": 0, "x": torch.zeros(3)}
    if not sm.is_first_stage():
        value = p2p.recv_forward()
    value = {"hops": value["hops"] + 1, "x": value["x"] + 1}
    if not sm.is_last_stage():
        p2p.send_forward(value)
        value = p2p.recv_backward()
    assert value["hops"] == 4 and torch.equal(value["x"], torch.full((3,), 4.0))
    if not sm.is_first_stage():
        p2p.send_backward(value)

    looped = PipelineStageManager(ProcessGroupMesh(4), 0, enable_interleave=True)
    assert looped.is_interleave and looped.num_model_chunks == 1
    ends = PipelineP2PCommunication(looped)
    if rank == 3:
        ends.send_forward(["wrap", torch.ones(1)])  # the last stage feeds the first
    elif rank == 0:
        assert same(ends.recv_forward(), ["wrap", torch.ones(1)])
