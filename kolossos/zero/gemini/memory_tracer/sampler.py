"""Sampling the peak non-model memory of a period, on devices with and without allocator stats.

:class:`AllocatorSampler` (GPUs) reads the caching allocator's peak since the last sample and
subtracts the model data that was on the device during the period. :class:`TrackerSampler` (CPU)
runs a :class:`~kolossos.accelerator.TensorMemoryTracker` for the sampled iteration and reads the
peak of every category except :data:`~kolossos.zero.gemini.memory_tracer.scope.MODEL_DATA`, so it
needs no subtraction. Storages that existed before sampling started (the input batch, say) are not
seen by the tracker; they are small next to activations, and documented as a limit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kolossos.accelerator import TensorMemoryTracker, get_accelerator
from kolossos.zero.gemini.memory_tracer.scope import MODEL_DATA

__all__ = ["AllocatorSampler", "MemorySampler", "TrackerSampler", "default_sampler"]


class MemorySampler(ABC):
    """Measures non-model device memory between sampling moments."""

    @abstractmethod
    def start(self) -> None:
        """Begin sampling: later peaks count from now."""

    @abstractmethod
    def sample(self, model_bytes: int) -> int:
        """Return the non-model peak since the previous sample (or :meth:`start`) and restart.

        Args:
            model_bytes: device bytes of model data during the period that ends now.
        """

    @abstractmethod
    def stop(self) -> None:
        """End sampling and release what :meth:`start` acquired (idempotent)."""


class AllocatorSampler(MemorySampler):
    """Non-model peak = the allocator's peak allocation in the period minus the model data."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._accelerator = get_accelerator()

    def _index(self) -> int | None:
        return self._device.index

    def start(self) -> None:
        """Restart the allocator's peak statistics."""
        self._accelerator.reset_peak_memory_stats(self._index())

    def sample(self, model_bytes: int) -> int:
        """Return ``max(0, peak - model_bytes)`` and restart the peak."""
        peak = self._accelerator.max_memory_allocated(self._index())
        self._accelerator.reset_peak_memory_stats(self._index())
        return max(0, int(peak) - model_bytes)

    def stop(self) -> None:
        """Nothing to release."""


class TrackerSampler(MemorySampler):
    """Non-model peak on the CPU from a tensor-storage tracker active while sampling.

    Chunk storages allocated under :func:`~kolossos.zero.gemini.memory_tracer.model_data_scope`
    are billed to ``MODEL_DATA`` and left out; every other category's peak since the previous
    sample is summed (an upper bound when several categories peak at different times; with no
    other tracker labels everything non-model is in one category and the figure is exact).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        self._tracker: TensorMemoryTracker | None = None

    @property
    def tracker(self) -> TensorMemoryTracker | None:
        """The tracker while sampling, else ``None``."""
        return self._tracker

    def start(self) -> None:
        """Enter a fresh tracker (leaving a previous one first)."""
        self.stop()
        self._tracker = TensorMemoryTracker(self._device)
        self._tracker.__enter__()

    def sample(self, model_bytes: int) -> int:
        """Return the non-model peak since the previous sample; ``model_bytes`` is not needed."""
        tracker = self._tracker
        if tracker is None:
            raise RuntimeError("TrackerSampler.sample() called before start().")
        peaks = tracker.category_peaks()
        tracker.reset_peak()
        return sum(n for name, n in peaks.items() if name != MODEL_DATA)

    def stop(self) -> None:
        """Leave the tracker if it is active."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None and tracker.active:
            tracker.__exit__(None, None, None)


def default_sampler(device: torch.device) -> MemorySampler:
    """Return the sampler for ``device``: allocator statistics, or a tracker on the CPU."""
    if device.type == "cpu":
        return TrackerSampler(device)
    return AllocatorSampler(device)
