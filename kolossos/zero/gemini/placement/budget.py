"""How many bytes of device memory Gemini may plan with.

By default the budget is the accelerator's total memory (the GPU's capacity; on a CPU-only machine
the host's RAM, where "device" and "host" are the same memory and nothing ever needs evicting). An
explicit ``device_memory_budget`` in bytes overrides it: on a GPU it leaves room for other work; on
the CPU it makes the memory manager's decisions, and its promise never to exceed the budget, visible
and testable.
"""

from __future__ import annotations

from dataclasses import dataclass

from kolossos.accelerator import get_accelerator

__all__ = ["DeviceBudget"]


def check_fraction(name: str, value: object, *, low_open: bool = False) -> float:
    """Return ``value`` as a float in [0, 1] (or (0, 1] with ``low_open``); raise otherwise.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: ``value`` is outside the interval.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a number in [0, 1], e.g. 0.5.")
    number = float(value)
    if not (0.0 < number <= 1.0 if low_open else 0.0 <= number <= 1.0):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name}={value!r} must lie in {interval}; pass e.g. 0.5.")
    return number


@dataclass(frozen=True, kw_only=True)
class DeviceBudget:
    """The device memory, in bytes, that Gemini's placement may use for model and non-model data.

    Example:
        >>> DeviceBudget.resolve(64 * 2**20).capacity_bytes  # an explicit 64 MiB budget
        67108864
        >>> DeviceBudget.resolve(None).source  # the accelerator's total memory
        'accelerator'
    """

    capacity_bytes: int
    """Bytes of device memory available to this process."""
    source: str = "explicit"
    """``"explicit"`` (``device_memory_budget``) or ``"accelerator"`` (its total memory)."""

    def __post_init__(self) -> None:
        value = self.capacity_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"device_memory_budget={value!r} must be a positive number of bytes, e.g. "
                "8 * 2**30 for 8 GiB, or None for the accelerator's total memory."
            )
        if self.source not in ("explicit", "accelerator"):
            raise ValueError(f"source={self.source!r} must be 'explicit' or 'accelerator'.")

    @classmethod
    def resolve(cls, device_memory_budget: int | None, *, fraction: float = 1.0) -> DeviceBudget:
        """Build the budget from an explicit byte count, or from the accelerator's memory.

        Args:
            device_memory_budget: bytes, or ``None`` for ``fraction`` of the current
                accelerator device's total memory.
            fraction: share of the accelerator's total memory to plan with when no explicit
                budget is given, in (0, 1].

        Raises:
            ValueError: a non-positive budget or a fraction outside (0, 1].
        """
        ratio = check_fraction("fraction", fraction, low_open=True)
        if device_memory_budget is not None:
            return cls(capacity_bytes=device_memory_budget, source="explicit")
        total = get_accelerator().total_memory()
        return cls(capacity_bytes=max(1, int(total * ratio)), source="accelerator")

    def share(self, ratio: float) -> int:
        """Return ``ratio`` of the capacity in whole bytes (rounded down)."""
        return int(self.capacity_bytes * ratio)
