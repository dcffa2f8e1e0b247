"""Per-rank memory of a block of training: model states and peak, from the accelerator's stats.

:class:`MemoryMeter` combines the two sources kolossos has (``docs/memory.md``): a
:class:`~kolossos.accelerator.TensorMemoryTracker`, which labels every storage (``params``,
``grads``, ``optim``, ...) and is the exact figure on the CPU, and on CUDA the caching allocator's
peak, which is what the device really had to hold. Memory per rank across the group is then one
``all_gather_object`` away (:func:`gather_from_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from kolossos.accelerator import TensorMemoryTracker, get_accelerator

__all__ = ["MODEL_STATE_CATEGORIES", "MemoryMeter", "RankMemory", "gather_from_ranks"]

#: tracker categories that make up the model states
MODEL_STATE_CATEGORIES = ("params", "grads", "optim")


@dataclass(frozen=True)
class RankMemory:
    """Memory figures of one rank (bytes)."""

    model_states: int
    """params + grads + optim at the moment :meth:`MemoryMeter.mark_model_states` saw them
    largest (call it after ``optimizer.step()``, before ``zero_grad``)"""
    peak: int
    """peak bytes over the block: the allocator's on CUDA, the tracker's elsewhere"""
    tracker_peak: int
    """the tracker's peak (tensor storages only), on every device"""
    source: str
    """where ``peak`` comes from: ``"allocator"`` or ``"tracker"``"""
    resident: int = 0
    """every counted tensor byte alive at :attr:`model_states`' moment (model states plus
    persistent buffers such as DDP's gradient buckets)"""
    breakdown: dict[str, int] = field(default_factory=dict)
    """bytes per tracker category at :attr:`model_states`' moment"""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "model_states": self.model_states,
            "peak": self.peak,
            "tracker_peak": self.tracker_peak,
            "source": self.source,
            "resident": self.resident,
            "breakdown": dict(self.breakdown),
        }


class MemoryMeter:
    """Measure one rank's memory over a block: enter it before building the model (so wrappers'
    buffers are seen), register what existed earlier with :meth:`track`, and call
    :meth:`mark_model_states` after each ``optimizer.step()``.

    Args:
        device: the device to measure (default: the accelerator's current device).

    Example:
        >>> with MemoryMeter() as meter:
        ...     model = build(); optimizer = make_optimizer(model)    # doctest: +SKIP
        ...     meter.track(model, optimizer)                          # doctest: +SKIP
        ...     train_step(); meter.mark_model_states()                # doctest: +SKIP
        >>> meter.result().model_states                                # doctest: +SKIP
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._accelerator = get_accelerator()
        self._device = torch.device(device or self._accelerator.get_current_device())
        self._tracker = TensorMemoryTracker(self._device)
        self._states = 0
        self._resident = 0
        self._breakdown: dict[str, int] = {}
        self._result: RankMemory | None = None

    @property
    def tracker(self) -> Any:
        """The underlying :class:`~kolossos.accelerator.TensorMemoryTracker`."""
        return self._tracker

    def track(self, *objects: Any) -> None:
        """Register modules, optimizers or tensors that existed before the block."""
        self._tracker.track(*objects)

    def mark_model_states(self) -> int:
        """Read params + grads + optim now; keep the largest reading. Returns the reading."""
        now = self._tracker.breakdown("current")
        states = sum(now.get(c, 0) for c in MODEL_STATE_CATEGORIES)
        if states >= self._states:
            self._states, self._breakdown = states, dict(now)
            self._resident = int(self._tracker.current_bytes)
        return states

    def reset_peak(self) -> None:
        """Restart the tracker's peak (e.g. after wrapping, to measure training only)."""
        self._tracker.reset_peak()
        if self._device.type != "cpu":
            self._accelerator.reset_peak_memory_stats()

    def __enter__(self) -> MemoryMeter:
        self._accelerator.synchronize()
        if self._device.type != "cpu":
            self._accelerator.reset_peak_memory_stats()
        self._tracker.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._accelerator.synchronize()
        self._tracker.__exit__(exc_type, exc, traceback)
        tracker_peak = int(self._tracker.peak_bytes)
        if self._device.type != "cpu" and self._accelerator.memory_stats_source() == "allocator":
            peak, source = int(self._accelerator.max_memory_allocated()), "allocator"
        else:
            peak, source = tracker_peak, "tracker"
        self._result = RankMemory(
            model_states=self._states,
            peak=peak,
            tracker_peak=tracker_peak,
            source=source,
            resident=self._resident,
            breakdown=self._breakdown,
        )

    def result(self) -> RankMemory:
        """The figures, after the block.

        Raises:
            RuntimeError: the block has not ended yet.
        """
        if self._result is None:
            raise RuntimeError("MemoryMeter.result() is available after its with-block ends.")
        return self._result


def gather_from_ranks(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
