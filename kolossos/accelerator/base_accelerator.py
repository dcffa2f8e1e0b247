"""The device abstraction that library code uses instead of calling ``torch.cuda`` directly.

An accelerator bundles what differs between hardware kinds: which device a rank computes on, which
``torch.distributed`` backend talks between ranks, random-number generators, synchronisation and
memory statistics. Library code asks :func:`kolossos.accelerator.get_accelerator` for the one in use
and never assumes CUDA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

__all__ = ["BaseAccelerator"]


class BaseAccelerator(ABC):
    """Interface of a compute device kind (``cpu``, ``cuda``).

    Subclasses set the three class attributes and implement the abstract methods. Every method works
    on the *current* device of the calling process unless it takes an index.

    Attributes:
        name: short name of the device kind, also the ``torch.device`` type (``"cpu"``, ``"cuda"``).
        communication_backend: the ``torch.distributed`` backend for this device (``"gloo"``,
            ``"nccl"``).
        amp_device_type: the ``device_type`` argument ``torch.autocast`` expects for this device.

    Example:
        >>> acc = get_accelerator()
        >>> x = torch.zeros(4, device=acc.get_current_device())
        >>> with torch.autocast(acc.amp_device_type, dtype=torch.bfloat16):
        ...     y = model(x)
    """

    name: ClassVar[str]
    communication_backend: ClassVar[str]
    amp_device_type: ClassVar[str]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, backend={self.communication_backend!r})"

    # ------------------------------------------------------------------ device
    @abstractmethod
    def is_available(self) -> bool:
        """Return whether this kind of device can be used by this process."""

    @abstractmethod
    def device_count(self) -> int:
        """Return the number of devices of this kind visible to this process."""

    @abstractmethod
    def current_device(self) -> int:
        """Return the index of the device this process computes on."""

    @abstractmethod
    def set_device(self, index: int) -> None:
        """Make device ``index`` the current device of this process.

        Args:
            index: a device index in ``[0, device_count())``.

        Raises:
            ValueError: ``index`` is negative or not below :meth:`device_count`.
        """

    def get_current_device(self) -> torch.device:
        """Return the current device as a ``torch.device`` (e.g. ``cuda:1`` or ``cpu``)."""
        return torch.device(self.name, self.current_device())

    def get_device_name(self, index: int | None = None) -> str:
        """Return a human-readable name of device ``index`` (default: the current one)."""
        return self.name

    @abstractmethod
    def synchronize(self, index: int | None = None) -> None:
        """Wait until all work queued on device ``index`` (default: current) has finished.

        A no-op on devices that execute synchronously (CPU).
        """

    def is_bf16_supported(self) -> bool:
        """Return whether bfloat16 arithmetic is supported on the current device."""
        return True

    # ------------------------------------------------------------------ random numbers
    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the random-number generator of the current device.

        Args:
            seed: a non-negative integer.
        """

    @abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed the random-number generators of every device of this kind.

        Args:
            seed: a non-negative integer.
        """

    @abstractmethod
    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """Return the state of the generator of device ``index`` (default: current) as a tensor."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """Restore a generator state returned by :meth:`get_rng_state`.

        Args:
            state: a ``torch.ByteTensor`` from :meth:`get_rng_state`.
            index: the device whose generator to set (default: current).
        """

    # ------------------------------------------------------------------ memory
    @abstractmethod
    def empty_cache(self) -> None:
        """Give cached but unused device memory back to the system (no-op where nothing caches)."""

    @abstractmethod
    def memory_allocated(self, index: int | None = None) -> int:
        """Return the bytes of tensor memory currently allocated on device ``index``."""

    @abstractmethod
    def max_memory_allocated(self, index: int | None = None) -> int:
        """Return the peak of :meth:`memory_allocated` since start or the last reset."""

    @abstractmethod
    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart peak tracking so that the peak equals the current allocation."""

    @abstractmethod
    def memory_reserved(self, index: int | None = None) -> int:
        """Return the bytes held by the device's allocator (allocated plus cached)."""

    @abstractmethod
    def total_memory(self, index: int | None = None) -> int:
        """Return the capacity of device ``index`` in bytes."""

    def memory_stats_source(self) -> str:
        """Say where :meth:`memory_allocated` and friends get their numbers right now.

        Returns:
            ``"allocator"`` (exact, from the device's caching allocator), ``"tracker"`` (exact, from
            an active :class:`~kolossos.accelerator.TensorMemoryTracker`) or ``"rss"`` (coarse,
            the process's resident set size). Benchmarks should print it next to memory figures.
        """
        return "allocator"

    # ------------------------------------------------------------------ helpers
    def _check_index(self, index: int) -> None:
        """Raise ``ValueError`` unless ``index`` names a device of this kind."""
        count = self.device_count()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < max(count, 1):
            raise ValueError(
                f"device index {index!r} is invalid for {self.name}: it must be an integer in "
                f"[0, {max(count, 1)}). Pass a local rank smaller than the number of devices."
            )

    @staticmethod
    def _check_seed(seed: int) -> None:
        """Raise ``ValueError`` unless ``seed`` is a non-negative integer."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer, e.g. 1024.")
