"""Huge-page backed host buffers (kolossos.accelerator.host_buffers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kolossos.accelerator import host_buffers
from kolossos.accelerator.host_buffers import MIN_ADVISED_BYTES, empty_host, huge_pages_advised

CPU = torch.device("cpu")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def fresh_mode() -> Iterator[None]:
    """Re-read the environment and the kernel's mode in the test, and afterwards."""
    host_buffers._madvise.cache_clear()
    yield
    host_buffers._madvise.cache_clear()


def test_empty_host_is_torch_empty_everywhere() -> None:
    for numel, dtype in [(10, torch.float32), (MIN_ADVISED_BYTES // 2 + 3, torch.bfloat16)]:
        out = empty_host(numel, dtype, CPU)
        assert out.shape == (numel,) and out.dtype == dtype and out.device == CPU
        out.fill_(1.5)  # writable over its whole length
        assert bool(out.eq(1.5).all())


def test_large_buffers_are_advised_huge_pages(fresh_mode: None) -> None:
    """On this development machine (Linux, THP in madvise mode) the test runs; where the kernel
    has THP in another mode it checks that nothing is advised."""
    try:
        with open(host_buffers._THP_MODE) as f:
            mode = f.read()
    except OSError:
        mode = ""
    assert huge_pages_advised() == ("[madvise]" in mode)
    big = empty_host(4 * MIN_ADVISED_BYTES // 4, torch.float32, CPU)  # 4 x the threshold
    middle = big.data_ptr() + big.numel() * 2  # inside a whole 2 MiB page of the buffer
    assert ("hg" in _vm_flags(middle)) == huge_pages_advised()
    small = empty_host(1024, torch.float32, CPU)
    if huge_pages_advised():
        assert "hg" not in _vm_flags(small.data_ptr())


def test_environment_switches_the_advice_off(
    fresh_mode: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KOLOSSOS_HUGE_PAGES", "0")
    assert not huge_pages_advised()
    big = empty_host(MIN_ADVISED_BYTES, torch.float32, CPU)
    assert "hg" not in _vm_flags(big.data_ptr() + big.numel() * 2)
