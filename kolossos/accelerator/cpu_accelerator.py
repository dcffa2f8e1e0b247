"""The CPU accelerator: computation on the host, ``gloo`` between ranks.

Memory statistics: torch keeps no allocator statistics for CPU tensors, so this accelerator answers
from the innermost active :class:`~kolossos.accelerator.TensorMemoryTracker` that tracks the CPU
(exact tensor bytes). Outside any tracker it falls back to the process's resident set size (RSS), a
coarse figure that includes the Python interpreter, libraries and freed-but-unreturned heap; see
``docs/memory.md``. :meth:`CpuAccelerator.memory_stats_source` says which one is in effect.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kolossos.accelerator._tracking_mode import active_tracker
from kolossos.accelerator.base_accelerator import BaseAccelerator

if TYPE_CHECKING:
    from kolossos.accelerator.memory_tracker import TensorMemoryTracker

__all__ = ["CpuAccelerator"]

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"


def _rss_bytes() -> int:
    """Return the resident set size of this process in bytes."""
    import psutil  # a declared dependency; imported lazily to keep ``import kolossos`` light

    return int(psutil.Process().memory_info().rss)


def _high_water_mark_bytes() -> int | None:
    """Return the kernel's peak RSS (``VmHWM``) of this process, or ``None`` off Linux."""
    try:
        with open(_PROC_STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CpuAccelerator(BaseAccelerator):
    """Computation on the host CPU; ranks communicate over ``gloo``.

    There is one logical CPU device (index 0). :meth:`set_device` accepts any non-negative index
    and ignores it, because every rank on a node shares the same host: launch code may call
    ``set_device(local_rank)`` without knowing the device kind.

    Example:
        >>> acc = CpuAccelerator()
        >>> acc.get_current_device()
        device(type='cpu')
        >>> with TensorMemoryTracker("cpu"):
        ...     x = torch.zeros(1024)
        ...     acc.memory_allocated()
        4096
    """

    name = "cpu"
    communication_backend = "gloo"
    amp_device_type = "cpu"

    def __init__(self) -> None:
        # Software peak used where the kernel's high-water mark cannot be reset.
        self._soft_peak: int | None = None

    # ------------------------------------------------------------------ device
    def is_available(self) -> bool:
        """Return ``True``: the host CPU is always there."""
        return True

    def device_count(self) -> int:
        """Return 1: the host is one logical device."""
        return 1

    def current_device(self) -> int:
        """Return 0, the only CPU index."""
        return 0

    def get_current_device(self) -> torch.device:
        """Return ``torch.device("cpu")`` (no index, as torch writes CPU devices)."""
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        """Accept and ignore ``index``: all ranks of a node share the host CPU.

        Raises:
            ValueError: ``index`` is not a non-negative integer.
        """
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"device index {index!r} must be a non-negative integer.")

    def get_device_name(self, index: int | None = None) -> str:
        """Return the processor's model name when the platform tells it, else ``"cpu"``."""
        import platform

        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
                for line in cpuinfo:
                    if line.startswith("model name"):
                        return line.partition(":")[2].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or "cpu"

    def synchronize(self, index: int | None = None) -> None:
        """Do nothing: CPU kernels finish before the call that launched them returns."""

    # ------------------------------------------------------------------ random numbers
    def manual_seed(self, seed: int) -> None:
        """Seed torch's default CPU generator."""
        self._check_seed(seed)
        torch.default_generator.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed torch's default CPU generator (there is only one CPU device)."""
        self.manual_seed(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """Return the state of torch's default CPU generator."""
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """Restore the default CPU generator from a state of :meth:`get_rng_state`."""
        torch.set_rng_state(state)

    # ------------------------------------------------------------------ memory
    def empty_cache(self) -> None:
        """Do nothing: the CPU allocator keeps no cache torch could release."""

    @staticmethod
    def _tracker() -> TensorMemoryTracker | None:
        return active_tracker("cpu")

    def memory_stats_source(self) -> str:
        """Return ``"tracker"`` inside an active CPU tracker, else ``"rss"``."""
        return "tracker" if self._tracker() is not None else "rss"

    def memory_allocated(self, index: int | None = None) -> int:
        """Return the live tensor bytes of the active tracker, or this process's RSS outside one.

        Args:
            index: ignored (one CPU device).

        Returns:
            Bytes. Exact inside a :class:`TensorMemoryTracker`; outside, the resident set size,
            which also counts the interpreter, libraries and heap that glibc has not returned.
        """
        tracker = self._tracker()
        if tracker is not None:
            return tracker.current_bytes
        return _rss_bytes()

    def max_memory_allocated(self, index: int | None = None) -> int:
        """Return the tracker's peak bytes, or the peak RSS since start or the last reset."""
        tracker = self._tracker()
        if tracker is not None:
            return tracker.peak_bytes
        current = _rss_bytes()
        if self._soft_peak is not None:
            self._soft_peak = max(self._soft_peak, current)
            return self._soft_peak
        hwm = _high_water_mark_bytes()
        return max(hwm, current) if hwm is not None else current

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Reset the active tracker's peak, or the process's peak RSS outside a tracker.

        Outside a tracker, the kernel's high-water mark is reset through
        ``/proc/self/clear_refs``; where that is not possible, later peaks are sampled at each
        :meth:`max_memory_allocated` call only (they can miss short spikes).
        """
        tracker = self._tracker()
        if tracker is not None:
            tracker.reset_peak()
            return
        try:
            with open(_PROC_CLEAR_REFS, "w", encoding="ascii") as clear_refs:
                clear_refs.write("5")  # 5 = reset the peak RSS (see proc(5))
            self._soft_peak = None
        except OSError:
            self._soft_peak = _rss_bytes()

    def memory_reserved(self, index: int | None = None) -> int:
        """Return :meth:`memory_allocated`: the CPU allocator caches nothing torch reports."""
        return self.memory_allocated(index)

    def total_memory(self, index: int | None = None) -> int:
        """Return the physical RAM of the host in bytes (not a container's limit)."""
        import psutil

        return int(psutil.virtual_memory().total)

    def cpu_count(self) -> int:
        """Return the number of CPUs this process may run on."""
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1
