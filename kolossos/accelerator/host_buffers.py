"""Large transient host buffers, backed by transparent huge pages where Linux offers them.

The ZeRO and Gemini engines allocate their per-step buffers afresh every step (gradient buckets,
the full gradient buffer of ZeRO-1, reduced partitions, gathered chunk payloads): they exist only
while they are needed, which keeps the peak memory low. On Linux a fresh allocation of that size
is a new anonymous mapping that the kernel faults in and zeroes 4 KiB at a time when it is first
written; for a 120 MB buffer that is about 29,000 page faults, which on the 2-core development
machine cost more CPU than copying the data in (``benchmarks/loopback_cost.py``). Backed by 2 MiB
pages the same buffer takes about 60 faults.

:func:`empty_host` asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) on such buffers
before they are touched, when transparent huge pages are in ``madvise`` mode (in ``always`` mode
the kernel uses them anyway; in ``never`` mode, off Linux, or with ``KOLOSSOS_HUGE_PAGES=0`` the
buffer is a plain ``torch.empty``). torch's own switch, ``THP_MEM_ALLOC_ENABLE=1``, covers every
allocation of the process and must be set before its first one; this covers only the engines'
buffers, whatever the process does otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable

import torch

__all__ = ["HUGE_PAGE_BYTES", "MIN_ADVISED_BYTES", "empty_host", "huge_pages_advised"]

HUGE_PAGE_BYTES = 2 * 2**20
"""The size of a transparent huge page on x86-64 and arm64 (with 4 KiB base pages)."""
MIN_ADVISED_BYTES = 4 * 2**20
"""Smaller buffers come from the allocator's heap and are reused; only larger ones are advised."""
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` when buffers should be advised (see the module doc), else ``None``."""
    if sys.platform != "linux" or os.environ.get("KOLOSSOS_HUGE_PAGES", "1") == "0":
        return None
    try:
        with open(_THP_MODE) as f:
            mode = f.read()
    except OSError:
        return None
    if "[madvise]" not in mode:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    func = libc.madvise
    func.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    func.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = func
    return advise


def huge_pages_advised() -> bool:
    """Whether :func:`empty_host` advises its large buffers (module doc)."""
    return _madvise() is not None


def empty_host(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype, device=device)``; on the host, a buffer of at least
    :data:`MIN_ADVISED_BYTES` is backed by transparent huge pages where the kernel allows it.

    The advice covers the whole 2 MiB pages inside the buffer and is given before anything is
    written, so the first writes fault in huge pages. Contents are undefined, as with
    ``torch.empty``.

    Example:
        >>> empty_host(8 * 2**20, torch.float32, torch.device("cpu")).numel()
        8388608
    """
    out = torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * out.element_size()
    if out.device.type != "cpu" or nbytes < MIN_ADVISED_BYTES:
        return out
    madvise = _madvise()
    if madvise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        stop = (out.data_ptr() + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if stop > start:
            madvise(start, stop - start, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return out
