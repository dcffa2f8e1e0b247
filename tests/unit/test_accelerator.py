"""The accelerator abstraction: selection, the CPU backend, and the CUDA backend on a GPU."""

from __future__ import annotations

import pytest
import torch

from kolossos.accelerator import (
    ACCELERATOR_ENV,
    BaseAccelerator,
    CpuAccelerator,
    CudaAccelerator,
    api,
    auto_set_accelerator,
    get_accelerator,
    set_accelerator,
)


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the cached accelerator before each test and restore it afterwards."""
    monkeypatch.setattr(api, "_accelerator", None)
    monkeypatch.delenv(ACCELERATOR_ENV, raising=False)


def test_default_choice_is_cached_and_follows_cuda_availability() -> None:
    acc = get_accelerator()
    assert acc is get_accelerator()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.name == expected == acc.amp_device_type
    assert acc.communication_backend == {"cpu": "gloo", "cuda": "nccl"}[expected]


def test_environment_forces_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "CPU")
    assert isinstance(get_accelerator(), CpuAccelerator)
    monkeypatch.setattr(api, "_accelerator", None)
    monkeypatch.setenv(ACCELERATOR_ENV, "tpu")
    with pytest.raises(ValueError, match="KOLOSSOS_ACCELERATOR='tpu'"):
        get_accelerator()


def test_forcing_unavailable_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(ACCELERATOR_ENV, "cuda")
    with pytest.raises(RuntimeError, match="KOLOSSOS_ACCELERATOR=cpu"):
        get_accelerator()
    with pytest.raises(RuntimeError, match="not available"):
        set_accelerator("cuda")


def test_set_and_auto_set() -> None:
    mine = CpuAccelerator()
    assert set_accelerator(mine) is mine and get_accelerator() is mine
    assert isinstance(set_accelerator("cpu"), CpuAccelerator)
    with pytest.raises(TypeError, match="BaseAccelerator"):
        set_accelerator(3)  # type: ignore[arg-type]
    assert auto_set_accelerator() is get_accelerator()
    with pytest.raises(TypeError):
        BaseAccelerator()  # type: ignore[abstract]


def test_cpu_device_rng_and_validation() -> None:
    acc = CpuAccelerator()
    assert acc.is_available() and acc.device_count() == 1 and acc.current_device() == 0
    assert acc.get_current_device() == torch.device("cpu")
    acc.set_device(3)  # every local rank shares the host: accepted, ignored
    with pytest.raises(ValueError, match="non-negative"):
        acc.set_device(-1)
    acc.synchronize()
    acc.empty_cache()
    assert isinstance(acc.get_device_name(), str) and acc.is_bf16_supported()
    acc.manual_seed(7)
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    acc.manual_seed_all(7)
    assert torch.equal(first, torch.rand(3))
    with pytest.raises(ValueError, match="seed"):
        acc.manual_seed(-1)


def test_cpu_memory_outside_a_tracker_is_rss() -> None:
    acc = CpuAccelerator()
    assert acc.memory_stats_source() == "rss"
    assert acc.total_memory() > acc.memory_allocated() > 0
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() >= acc.memory_allocated() > 0
    assert acc.memory_reserved() > 0


@pytest.mark.gpu
def test_cuda_accelerator_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    acc = CudaAccelerator()
    acc.set_device(0)
    assert acc.get_current_device() == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="device index"):
        acc.set_device(acc.device_count())
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    x = torch.empty(1 << 20, device=acc.get_current_device())
    assert acc.memory_allocated() - before == x.numel() * 4
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.total_memory() > 0 and acc.memory_reserved() >= acc.memory_allocated()
    acc.manual_seed(3)
    state = acc.get_rng_state()
    first = torch.rand(3, device="cuda")
    acc.set_rng_state(state)
    assert torch.equal(first, torch.rand(3, device="cuda"))
    acc.synchronize()
