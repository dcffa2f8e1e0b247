"""Exact per-process accounting of tensor memory, for devices without allocator statistics (CPU).

:class:`TensorMemoryTracker` is a context manager. While it is active, a ``TorchDispatchMode`` sees
every operator call of this thread (and of autograd's backward, which inherits the mode) and enters
the storage of each output tensor into a ledger once, unless the output merely aliases an input
(views, in-place and ``out=`` ops). A storage leaves the ledger when its memory is released. Tensors
that existed before entry are invisible unless registered with :meth:`TensorMemoryTracker.track`.
How it measures, and what it cannot see, is written up in ``docs/memory.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from kolossos.accelerator._storage_ledger import StorageLedger
from kolossos.accelerator._tracker_hooks import install_hooks, remove_hooks, sweep, track_object
from kolossos.accelerator._tracking_mode import (
    TrackingMode,
    activate,
    active_tracker,
    deactivate,
    storages_of,
)
from kolossos.accelerator.api import get_accelerator
from kolossos.accelerator.memory_categories import (
    ACTIVATIONS,
    BUFFERS,
    GRADS,
    OPTIM,
    OTHER,
    PARAMS,
)

__all__ = [
    "ACTIVATIONS",
    "BUFFERS",
    "GRADS",
    "OPTIM",
    "OTHER",
    "PARAMS",
    "TensorMemoryTracker",
    "active_tracker",
]


class TensorMemoryTracker:
    """Count the bytes of live tensor storages on one device, current and peak, by category.

    Inside ``with tracker:`` every storage allocated by an operator on ``device`` is counted once
    (views and in-place results are not new memory) and subtracted when freed; this covers factory
    functions, autograd's gradients, optimizer states (single-tensor, foreach and fused paths) and
    outputs allocated by collectives. Pre-existing tensors, modules and optimizers are added with
    :meth:`track`. Counted storages stay accounted, and are subtracted when freed, after the
    ``with`` block as long as the tracker object is alive.

    While it is the innermost active tracker of the CPU, ``get_accelerator().memory_allocated()``
    and friends report its figures on a CPU accelerator.

    Args:
        device: the device whose storages to count; a device without index (``"cuda"``) counts
            every device of that type. Default: the current accelerator device.

    Example:
        >>> model = torch.nn.Linear(256, 256)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> with TensorMemoryTracker("cpu") as tracker:
        ...     tracker.track(model, optimizer)
        ...     with tracker.category(ACTIVATIONS):
        ...         loss = model(torch.randn(8, 256)).sum()
        ...     loss.backward()
        ...     optimizer.step()
        >>> tracker.breakdown()  # {'params': 263168, 'grads': 263168, 'optim': 526344, ...}
        >>> tracker.peak_bytes
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = get_accelerator().get_current_device()
        self._device = torch.device(device)
        self._ledger = StorageLedger()
        self._categories: list[str] = [OTHER]
        self._mode: TrackingMode | None = None
        # Watched modules and optimizers, with the category override they were tracked under.
        self._owners: list[tuple[weakref.ref[Any], str | None]] = []
        self._hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._handles: list[RemovableHandle] = []

    # ------------------------------------------------------------------ results
    @property
    def device(self) -> torch.device:
        """The device whose storages are counted."""
        return self._device

    @property
    def active(self) -> bool:
        """Whether the tracker is inside its ``with`` block."""
        return self._mode is not None

    @property
    def current_bytes(self) -> int:
        """Bytes of the counted storages alive now."""
        return self._ledger.current

    @property
    def peak_bytes(self) -> int:
        """Largest :attr:`current_bytes` since creation or the last :meth:`reset_peak`."""
        return self._ledger.peak

    @property
    def num_storages(self) -> int:
        """Number of counted storages alive now."""
        return len(self._ledger)

    def breakdown(self, when: str = "current") -> dict[str, int]:
        """Return bytes per category, now (``"current"``) or at the overall peak (``"peak"``).

        Raises:
            ValueError: ``when`` is neither ``"current"`` nor ``"peak"``.
        """
        if when == "current":
            return self._ledger.breakdown()
        if when == "peak":
            return self._ledger.peak_breakdown()
        raise ValueError(f"when={when!r} must be 'current' or 'peak'.")

    def category_peaks(self) -> dict[str, int]:
        """Return each category's own peak bytes (reached at possibly different moments)."""
        return self._ledger.category_peaks()

    def reset_peak(self) -> None:
        """Restart peak tracking from the current figures."""
        self._ledger.reset_peak()

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        """Return whether every storage of ``tensor`` is counted."""
        storages = list(storages_of(tensor))
        return bool(storages) and all(storage in self._ledger for storage in storages)

    def summary(self, unit: str = "MiB") -> str:
        """Return a small table of current and peak bytes per category in ``unit`` (B/KiB/MiB/GiB).

        Raises:
            ValueError: an unknown unit.
        """
        scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
        if unit not in scale:
            raise ValueError(f"unit={unit!r} must be one of {list(scale)}.")
        now, at_peak = self.breakdown("current"), self.breakdown("peak")
        lines = [f"{'category':<12} {'current':>12} {'at peak':>12}  ({unit}, {self._device})"]
        for name in sorted(set(now) | set(at_peak)):
            cur, top = now.get(name, 0) / scale[unit], at_peak.get(name, 0) / scale[unit]
            lines.append(f"{name:<12} {cur:>12.3f} {top:>12.3f}")
        total, peak = self.current_bytes / scale[unit], self.peak_bytes / scale[unit]
        lines.append(f"{'total':<12} {total:>12.3f} {peak:>12.3f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"TensorMemoryTracker(device={str(self._device)!r}, "
            f"current_bytes={self.current_bytes}, peak_bytes={self.peak_bytes}, "
            f"active={self.active})"
        )

    # ------------------------------------------------------------------ labelling
    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        """Bill storages first seen inside this block to category ``name`` (blocks nest).

        Raises:
            ValueError: ``name`` is not a non-empty string.

        Example:
            >>> with tracker.category(ACTIVATIONS):
            ...     out = model(batch)
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"category name {name!r} must be a non-empty string.")
        self._categories.append(name)
        try:
            yield
        finally:
            self._categories.pop()

    def track(self, *objects: Any, category: str | None = None) -> None:
        """Count storages that already exist: tensors, modules, optimizers, or containers of them.

        Modules contribute parameters (``params``), buffers (``buffers``) and gradients
        (``grads``); optimizers their parameters, gradients and states (``optim``). Modules and
        optimizers are also watched: gradients accumulated and states created while the tracker
        is active are billed to ``grads`` and ``optim``. Storages already counted move to the
        new category; nothing is counted twice.

        Args:
            *objects: ``torch.Tensor``, ``torch.nn.Module``, ``torch.optim.Optimizer``, or
                lists, tuples, sets and dict values of those.
            category: bill everything passed to this category instead of the automatic ones.

        Raises:
            TypeError: an object of another type.
        """
        for obj in objects:
            track_object(self, obj, category)
        if self.active:
            install_hooks(self)

    def _count(self, tensor: torch.Tensor | None, category: str) -> None:
        """Count (or re-bill) every storage of ``tensor`` on the tracked device."""
        if tensor is None:
            return
        for storage in storages_of(tensor):
            if self._wants(storage):
                self._ledger.add_or_relabel(storage, category)

    def _wants(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` lives on the tracked device."""
        device = storage.device
        return device.type == self._device.type and (
            self._device.index is None or device.index == self._device.index
        )

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> TensorMemoryTracker:
        if self._mode is not None:
            raise RuntimeError("this TensorMemoryTracker is already active; use a new one to nest.")
        activate(self)
        install_hooks(self)
        self._mode = TrackingMode(self)
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._mode is not None
        mode, self._mode = self._mode, None
        mode.__exit__(exc_type, exc, traceback)
        sweep(self)
        remove_hooks(self)
        deactivate(self)
