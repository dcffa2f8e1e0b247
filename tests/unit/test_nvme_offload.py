"""NVMe offload of CPUAdam/HybridAdam states: layout plan, bitwise equality with resident states,
state-dict round trips, bounded memory, and clear errors before training for unusable
directories. Small models, 1 MiB units so that parameters split across several units."""

from __future__ import annotations

import copy
import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from kolossos.nn.optimizer import CPUAdam, HybridAdam
from kolossos.nn.optimizer.nvme import NVMeOffloadError, SwapFile, offloader
from kolossos.nn.optimizer.nvme import swap_file as swap_module
from kolossos.nn.optimizer.nvme.plan import ALIGN, plan_units, select_offloaded

UNIT_BYTES = 1 << 20  # 128 Ki fp32 elements of exp_avg + exp_avg_sq per unit


@pytest.fixture(autouse=True)
def small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offloader, "DEFAULT_UNIT_BYTES", UNIT_BYTES)


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)  # 300 Ki-element first layer: split over three units
    model = nn.Sequential(nn.Linear(300, 1024), nn.ReLU(), nn.Linear(1024, 40), nn.Linear(40, 3))
    return model.to(dtype)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    gen = torch.Generator().manual_seed(7)
    dtype = next(model.parameters()).dtype
    for i in range(start + steps):
        x = torch.randn(4, 300, generator=gen).to(dtype)
        if i < start:
            continue
        opt.zero_grad()
        model[2].weight.requires_grad_(i % 3 != 1)  # some steps leave a parameter without grad
        model(x).float().pow(2).mean().backward()
        opt.step()


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- plan


def test_select_offloaded_is_greedy_by_numel() -> None:
    assert select_offloaded([(10, True), (30, True), (60, True)], 0.5) == [True, True, False]
    assert select_offloaded([(10, True), (60, True), (30, True)], 0.5) == [True, False, True]
    assert select_offloaded([(50, False), (50, True)], 1.0) == [False, True]
    assert select_offloaded([(1, True)], 0.0) == [False]


def test_plan_splits_on_aligned_elements_and_keeps_groups_apart() -> None:
    units = plan_units(
        [(0, 3 * ALIGN + 5, torch.float32), (0, 10, torch.float32), (1, 7, torch.float32)],
        num_states=2,
        unit_numel=2 * ALIGN + 100,
    )
    spans = [[(s.param, s.start, s.stop, s.offset) for s in u.segments] for u in units]
    assert spans == [
        [(0, 0, 2 * ALIGN, 0)],
        [(0, 2 * ALIGN, 3 * ALIGN + 5, 0), (1, 0, 10, ALIGN + 5)],
        [(2, 0, 7, 0)],
    ]
    assert [u.group for u in units] == [0, 0, 1]
    assert all(u.file_offset % 4096 == 0 for u in units)
    assert units[1].nbytes == (ALIGN + 15) * 2 * 4


# ---------------------------------------------------------------- equality with resident states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_offloaded_training_is_bitwise_identical(dtype: torch.dtype, fraction: float) -> None:
    resident, streamed = make_model(dtype), make_model(dtype)
    train(resident, CPUAdam(resident.parameters(), lr=1e-2, weight_decay=0.1), 5)
    opt = HybridAdam(streamed.parameters(), lr=1e-2, weight_decay=0.1,
                     nvme_offload_fraction=fraction)  # fmt: skip
    total = sum(p.numel() for p in streamed.parameters())
    assert 0 < opt.nvme_offloaded_bytes <= fraction * 8 * total
    train(streamed, opt, 5)
    assert_same(resident, streamed)
    held = [p for p in streamed.parameters() if opt._is_streamed(p)]
    assert held and all(set(opt.state[p]) == {"step"} for p in held)  # states are on disk
    assert opt._offloader._allocated <= 3  # at most three units in memory
    opt.close()


def test_param_groups_with_different_hyper_parameters() -> None:
    def groups(model: nn.Module) -> list[dict[str, object]]:
        decay = [p for p in model.parameters() if p.dim() > 1]
        rest = [p for p in model.parameters() if p.dim() <= 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-2}]

    resident, streamed = make_model(), make_model()
    train(resident, CPUAdam(groups(resident), lr=1e-2), 4)
    opt = CPUAdam(groups(streamed), lr=1e-2, nvme_offload_fraction=1.0)
    assert {u.group for u in opt._offloader.units} == {0, 1}
    train(streamed, opt, 4)
    assert_same(resident, streamed)
    opt.close()


def test_state_dict_round_trips_between_offloaded_and_resident(tmp_path: Path) -> None:
    straight = make_model()
    train(straight, CPUAdam(straight.parameters(), lr=1e-2), 6)
    for src_fraction, dst_fraction in ((1.0, 0.0), (0.0, 1.0), (1.0, 0.5)):
        model = make_model()
        first = CPUAdam(model.parameters(), lr=1e-2, nvme_offload_fraction=src_fraction,
                        nvme_offload_dir=tmp_path)  # fmt: skip
        train(model, first, 3)
        saved = copy.deepcopy(first.state_dict())
        assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in saved["state"].values())
        second = CPUAdam(model.parameters(), lr=1e-2, nvme_offload_fraction=dst_fraction,
                         nvme_offload_dir=tmp_path)  # fmt: skip
        second.load_state_dict(saved)
        train(model, second, 3, start=3)
        assert_same(straight, model)
        first.close()
        second.close()


def test_loading_a_state_dict_without_a_params_state_resets_it() -> None:
    model = make_model()
    opt = CPUAdam(model.parameters(), lr=1e-2, nvme_offload_fraction=1.0)
    train(model, opt, 2)
    fresh = CPUAdam(make_model().parameters(), lr=1e-2).state_dict()  # no state at all
    opt.load_state_dict(fresh)
    assert opt.state_dict()["state"] == {}
    p = next(model.parameters())
    assert not opt._offloader.read_param_state(p)["exp_avg"].any()
    opt.close()


# ---------------------------------------------------------------- files, errors, cleanup


def test_swap_file_is_invisible_and_temp_dir_goes_on_close(tmp_path: Path) -> None:
    opt = CPUAdam(make_model().parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked right after creation: nothing to clean up
    opt.close()
    private = CPUAdam(make_model().parameters(), nvme_offload_fraction=1.0)
    directory = private._offloader.swap.directory
    assert directory.is_dir() and directory.name.startswith("kolossos-nvme-")
    private.close()
    private.close()  # idempotent
    assert not directory.exists()


def test_private_temp_dir_removed_at_exit(tmp_path: Path) -> None:
    code = (
        "import torch\n"
        "from kolossos.nn.optimizer import CPUAdam\n"
        "opt = CPUAdam([torch.nn.Parameter(torch.ones(1000))], nvme_offload_fraction=1.0)\n"
        "print(opt._offloader.swap.directory)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    directory = Path(out.stdout.strip().splitlines()[-1])
    assert directory.parent == tmp_path
    assert not directory.exists() and list(tmp_path.iterdir()) == []


def test_unwritable_directory_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(NVMeOffloadError, match="cannot be written"):
        CPUAdam(make_model().parameters(), nvme_offload_fraction=1.0,
                nvme_offload_dir=blocker / "sub")  # fmt: skip
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(NVMeOffloadError, match="cannot be written"):
            CPUAdam(make_model().parameters(), nvme_offload_fraction=1.0,
                    nvme_offload_dir=locked)  # fmt: skip


def test_too_little_space_fails_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = namedtuple("usage", "total used free")
    real_disk_usage = shutil.disk_usage
    monkeypatch.setattr(swap_module.shutil, "disk_usage", lambda _: usage(10**6, 0, 10**6))
    with pytest.raises(NVMeOffloadError, match=r"free.*needs") as info:
        CPUAdam(make_model().parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=tmp_path)
    assert info.value.errno == errno.ENOSPC and str(tmp_path) in str(info.value)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(swap_module.shutil, "disk_usage", real_disk_usage)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap_module.os, "posix_fallocate", full)
    with pytest.raises(NVMeOffloadError, match="disk is full"):
        CPUAdam(make_model().parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=tmp_path)


def test_io_errors_surface_in_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    opt = CPUAdam(model.parameters(), lr=1e-2, nvme_offload_fraction=1.0)
    train(model, opt, 1)

    def broken(self: SwapFile, offset: int, data: torch.Tensor) -> None:
        raise OSError(errno.EIO, "simulated I/O error")

    monkeypatch.setattr(SwapFile, "write", broken)
    with pytest.raises(OSError, match="simulated"):
        train(model, opt, 1, start=1)
        opt.state_dict()  # the last writes may still be in flight after step()
    monkeypatch.undo()
    opt.close()


def test_pickling_refused_with_offload_allowed_without() -> None:
    params = list(make_model().parameters())
    copy.deepcopy(CPUAdam(params))
    opt = CPUAdam(params, nvme_offload_fraction=1.0)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)
    opt.close()


def test_offload_only_applies_to_cpu_contiguous_params() -> None:
    model = make_model()
    strided = nn.Parameter(torch.randn(64, 64).t())  # not contiguous: stays in memory
    opt = CPUAdam([*model.parameters(), strided], nvme_offload_fraction=1.0)
    assert not opt._is_streamed(strided)
    assert opt.nvme_offloaded_bytes == 8 * sum(p.numel() for p in model.parameters())
    opt.close()
