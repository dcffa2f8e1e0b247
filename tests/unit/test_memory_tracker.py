"""TensorMemoryTracker: exact byte counts on CPU against hand-computed formulas."""

from __future__ import annotations

import copy
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from kolossos.accelerator import (
    ACTIVATIONS,
    GRADS,
    OPTIM,
    PARAMS,
    CpuAccelerator,
    TensorMemoryTracker,
    active_tracker,
)

F32 = 4  # bytes per float32 element


def _consistent(tracker: TensorMemoryTracker) -> None:
    """The per-category figures add up to the total, and the peak is never below it."""
    assert sum(tracker.breakdown().values()) == tracker.current_bytes
    assert sum(tracker.breakdown("peak").values()) == tracker.peak_bytes
    assert tracker.peak_bytes >= tracker.current_bytes


def _linear_bytes(n_in: int, n_out: int) -> int:
    return (n_in * n_out + n_out) * F32


@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs"),
    [
        (torch.optim.Adam, {"foreach": False}),
        (torch.optim.Adam, {"foreach": True}),
        (torch.optim.AdamW, {"fused": True}),
    ],
    ids=["adam-single", "adam-foreach", "adamw-fused"],
)
def test_linear_params_grads_adam_states_exact(optimizer_cls: type, kwargs: dict) -> None:
    model = nn.Linear(64, 32)
    optimizer = optimizer_cls(model.parameters(), lr=1e-3, **kwargs)
    psi = _linear_bytes(64, 32)
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model, optimizer)
        assert tracker.breakdown() == {PARAMS: psi}
        for _ in range(2):  # the second step accumulates into existing state: no growth
            model(torch.randn(8, 64)).square().mean().backward()
            optimizer.step()
        _consistent(tracker)
    # Adam keeps exp_avg and exp_avg_sq (2 psi) plus one float32 ``step`` scalar per parameter.
    expected = {PARAMS: psi, GRADS: psi, OPTIM: 2 * psi + 2 * F32}
    assert tracker.breakdown() == expected
    assert tracker.current_bytes == sum(expected.values())


def test_views_and_inplace_ops_are_not_double_counted() -> None:
    older = torch.randn(100)
    with TensorMemoryTracker("cpu") as tracker:
        base = torch.empty(1000)
        views = [base.view(10, 100), base[10:20], base.t(), base.view(10, 100).T, base.detach()]
        base.add_(1).mul_(2)
        torch.add(base, 1, out=base)
        older.view(10, 10).add_(1)  # aliases a storage from before entry: not counted
        assert tracker.current_bytes == 1000 * F32
        assert tracker.num_storages == 1
        assert all(tracker.is_tracked(view) for view in views)
        assert not tracker.is_tracked(older)


def test_freed_activations_are_subtracted() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model)
        params = tracker.current_bytes
        with tracker.category(ACTIVATIONS):
            loss = model(torch.randn(16, 32)).sum()
        assert tracker.breakdown()[ACTIVATIONS] > 0
        loss.backward()
        del loss  # autograd's saved activations go with the graph
        assert ACTIVATIONS not in tracker.breakdown()
        assert tracker.current_bytes == 2 * params  # parameters and their gradients
        assert tracker.breakdown("peak")[ACTIVATIONS] > 0
        _consistent(tracker)


def test_peak_during_mlp_forward_matches_hand_count() -> None:
    batch, d_in, hidden, d_out = 16, 32, 128, 8
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model)
        params = tracker.current_bytes
        assert params == _linear_bytes(d_in, hidden) + _linear_bytes(hidden, d_out)
        x = torch.randn(batch, d_in)
        tracker.reset_peak()
        out = model(x)
        # Alive at once: x, the first Linear's output and ReLU's output (Sequential drops the
        # former only after ReLU returns); then x, ReLU's output (saved for backward) and ``out``.
        acts = batch * F32 * (d_in + max(2 * hidden, hidden + d_out))
        assert tracker.peak_bytes == params + acts
        assert tracker.current_bytes == params + batch * F32 * (d_in + hidden + d_out)
        del out
        assert tracker.current_bytes == params + batch * d_in * F32
        _consistent(tracker)


def test_track_registers_a_preexisting_model_and_its_grads() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    model(torch.randn(4, 16)).sum().backward()  # gradients exist before the tracker
    psi = _linear_bytes(16, 16) + 2 * 16 * F32  # Linear + BatchNorm weight and bias
    buffers = 2 * 16 * F32 + 8  # running mean/var + int64 num_batches_tracked
    with TensorMemoryTracker("cpu") as tracker:
        assert tracker.current_bytes == 0  # invisible until registered
        tracker.track(model)
        assert tracker.breakdown() == {PARAMS: psi, GRADS: psi, "buffers": buffers}
        tracker.track(model)  # idempotent
        assert tracker.current_bytes == 2 * psi + buffers


def test_grads_are_counted_and_accumulated_in_place() -> None:
    model = nn.Linear(8, 4)
    psi = _linear_bytes(8, 4)
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            assert tracker.breakdown()[GRADS] == psi
    model.zero_grad(set_to_none=True)  # after exit: freed storages are still subtracted
    assert tracker.breakdown() == {PARAMS: psi}


def test_factories_tensor_literals_and_storage_resize() -> None:
    with TensorMemoryTracker("cpu") as tracker:
        tensors = [torch.empty(10), torch.zeros(10), torch.randn(10), torch.ones(2, 5)]
        tensors.append(torch.empty_like(tensors[0]))
        tensors.append(torch.tensor([1.0, 2.0, 3.0]))
        tensors.append(torch.arange(10, dtype=torch.int64))
        assert tracker.current_bytes == 5 * 10 * F32 + 3 * F32 + 10 * 8
        storage = tensors[0].untyped_storage()
        storage.resize_(0)  # how FSDP2 frees unsharded parameters: outside the dispatcher
        assert tracker.current_bytes == 4 * 10 * F32 + 3 * F32 + 10 * 8
        storage.resize_(400)
        assert tracker.current_bytes == 400 + 4 * 10 * F32 + 3 * F32 + 10 * 8
    assert tracker.num_storages == len(tensors)


def test_nested_trackers_and_accelerator_wiring() -> None:
    acc = CpuAccelerator()
    original_resize = torch.UntypedStorage.resize_
    assert acc.memory_stats_source() == "rss"
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() >= acc.memory_allocated()
    with TensorMemoryTracker("cpu") as outer:
        a = torch.empty(256)
        with TensorMemoryTracker("cpu") as inner:
            assert active_tracker("cpu") is inner
            b = torch.empty(512)
            assert acc.memory_stats_source() == "tracker"
            assert acc.memory_allocated() == inner.current_bytes == 512 * F32
        assert active_tracker("cpu") is outer
        assert outer.current_bytes == acc.memory_allocated() == (256 + 512) * F32
        del b
        acc.reset_peak_memory_stats()
        assert acc.max_memory_allocated() == outer.peak_bytes == 256 * F32
        with pytest.raises(RuntimeError, match="already active"):
            outer.__enter__()
    assert active_tracker("cpu") is None and acc.memory_stats_source() == "rss"
    assert torch.UntypedStorage.resize_ is original_resize  # the patch is undone
    del a


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch 2.13 renames all_gather_into_tensor
def test_collective_outputs_are_counted(tmp_path: Path) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        with TensorMemoryTracker("cpu") as tracker:
            x = torch.ones(256)
            out = torch.empty(256)
            dist.all_gather_into_tensor(out, x)
            dist.all_reduce(x)  # in place: nothing new
            assert tracker.current_bytes == 2 * 256 * F32
            y = funcol.wait_tensor(
                funcol.all_reduce(x, "sum", dist.distributed_c10d._get_default_group())
            )
            assert tracker.current_bytes == 3 * 256 * F32
            del y
    finally:
        dist.destroy_process_group()


def test_track_rejects_unknown_objects_and_reports() -> None:
    tracker = TensorMemoryTracker("cpu")
    with pytest.raises(TypeError, match="takes tensors"):
        tracker.track("params")
    with pytest.raises(ValueError, match="'current' or 'peak'"):
        tracker.breakdown("max")
    weight, extra = nn.Parameter(torch.zeros(4)), torch.zeros(2)
    tracker.track({"w": weight, "extra": [extra]})
    assert tracker.breakdown() == {PARAMS: 16, "other": 8}
    assert "total" in tracker.summary("B") and "params" in tracker.summary("KiB")


def test_cross_check_with_pytorch_memtracker() -> None:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception as exc:  # private module: may move or break between releases
        pytest.skip(f"torch.distributed._tools.mem_tracker.MemTracker not importable: {exc}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16))
    reference_model = copy.deepcopy(model)
    batch = torch.randn(32, 64)

    def train_step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        m(batch).square().mean().backward()
        opt.step()

    opt = torch.optim.Adam(reference_model.parameters(), foreach=True)
    try:
        reference = MemTracker()
        reference.track_external(reference_model, opt)
        with reference:
            train_step(reference_model, opt)
        dev = torch.device("cpu")
        ref_peak = reference.get_tracker_snapshot("peak")[dev]["Total"]
        ref_now = reference.get_tracker_snapshot("current")[dev]["Total"]
    except Exception as exc:
        pytest.skip(f"PyTorch's MemTracker does not run on CPU here: {exc}")

    opt = torch.optim.Adam(model.parameters(), foreach=True)
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model, opt)
        train_step(model, opt)
    assert tracker.peak_bytes == ref_peak
    assert tracker.current_bytes == ref_now
