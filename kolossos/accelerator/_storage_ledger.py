"""Byte accounting of tensor storages, keyed weakly: the bookkeeping behind TensorMemoryTracker.

A storage is entered once (its size added to the running total and to its category), and leaves
when its last reference dies: a ``weakref.finalize`` on the Python storage object subtracts it. The
Python object of a storage lives exactly as long as the C++ storage does (torch preserves it while
C++ holds references), so the finalizer fires when the memory is really released.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import torch

__all__ = ["StorageLedger"]


class _Entry:
    """One accounted storage: its size when last seen and the category it is billed to."""

    __slots__ = ("category", "nbytes")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes = nbytes
        self.category = category


def _release(ledger_ref: weakref.ref[StorageLedger], key: int, entry: _Entry) -> None:
    """Finalizer of a storage: subtract it from its ledger, if the ledger still exists."""
    ledger = ledger_ref()
    if ledger is not None:
        ledger.forget(key, entry)


class StorageLedger:
    """Current bytes, peak bytes and per-category bytes of a set of live storages.

    Thread-safe: finalizers may run on any thread (e.g. autograd's device threads).
    """

    def __init__(self) -> None:
        # Re-entrant: a finalizer can fire (and call forget) while this thread holds the lock.
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        self._by_category: defaultdict[str, int] = defaultdict(int)
        self._category_peak: defaultdict[str, int] = defaultdict(int)
        self._current = 0
        self._peak = 0
        self._peak_breakdown: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def current(self) -> int:
        """Bytes of the storages alive now."""
        return self._current

    @property
    def peak(self) -> int:
        """Largest value :attr:`current` reached since creation or :meth:`reset_peak`."""
        return self._peak

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._entries

    def breakdown(self) -> dict[str, int]:
        """Return current bytes per category (categories with zero bytes omitted)."""
        with self._lock:
            return {name: n for name, n in self._by_category.items() if n}

    def peak_breakdown(self) -> dict[str, int]:
        """Return bytes per category at the moment the overall peak was reached."""
        with self._lock:
            return {name: n for name, n in self._peak_breakdown.items() if n}

    def category_peaks(self) -> dict[str, int]:
        """Return each category's own peak since creation or :meth:`reset_peak`."""
        with self._lock:
            return {name: n for name, n in self._category_peak.items() if n}

    # ------------------------------------------------------------------ updates
    def add(self, storage: torch.UntypedStorage, category: str) -> bool:
        """Account ``storage`` under ``category`` unless it already is.

        Returns:
            ``True`` if the storage was new to the ledger.
        """
        key = storage._cdata
        with self._lock:
            if key in self._entries:
                return False
            entry = _Entry(storage.nbytes(), category)
            self._entries[key] = entry
            finalizer = weakref.finalize(storage, _release, weakref.ref(self), key, entry)
            finalizer.atexit = False  # nothing to account once the interpreter is going away
            self._change(category, entry.nbytes)
            return True

    def add_or_relabel(self, storage: torch.UntypedStorage, category: str) -> None:
        """Account ``storage`` under ``category``, moving it there if it is billed elsewhere."""
        if not self.add(storage, category):
            self.relabel(storage, category)

    def relabel(self, storage: torch.UntypedStorage, category: str) -> None:
        """Bill an accounted storage to ``category`` (total unchanged); unknown ones are ignored."""
        with self._lock:
            entry = self._entries.get(storage._cdata)
            if entry is None or entry.category == category:
                return
            self._by_category[entry.category] -= entry.nbytes
            entry.category = category
            value = self._by_category[category] + entry.nbytes
            self._by_category[category] = value
            self._category_peak[category] = max(self._category_peak[category], value)

    def refresh(self, storage: torch.UntypedStorage) -> None:
        """Re-read the size of a counted storage (after ``resize_``); unknown ones are ignored."""
        with self._lock:
            entry = self._entries.get(storage._cdata)
            if entry is None:
                return
            nbytes = storage.nbytes()
            if nbytes != entry.nbytes:
                delta = nbytes - entry.nbytes
                entry.nbytes = nbytes
                self._change(entry.category, delta)

    def forget(self, key: int, entry: _Entry) -> None:
        """Subtract a storage that was released (called by its finalizer)."""
        with self._lock:
            # The address may already belong to a newer storage: only drop our own entry.
            if self._entries.get(key) is entry:
                del self._entries[key]
                self._change(entry.category, -entry.nbytes)

    def reset_peak(self) -> None:
        """Make the peak (overall and per category) equal to the current figures."""
        with self._lock:
            self._peak = self._current
            self._peak_breakdown = dict(self._by_category)
            self._category_peak = defaultdict(int, self._by_category)

    def _change(self, category: str, delta: int) -> None:
        """Apply ``delta`` bytes to ``category`` and the total; update peaks. Lock held."""
        self._current += delta
        value = self._by_category[category] + delta
        self._by_category[category] = value
        if value > self._category_peak[category]:
            self._category_peak[category] = value
        if self._current > self._peak:
            self._peak = self._current
            self._peak_breakdown = dict(self._by_category)
