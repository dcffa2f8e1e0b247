"""What Gemini learns in a warm-up iteration: non-model memory per period, and chunk access order.

A *moment* is one call of the placement policy's ``before_compute``: a group of chunks is about to
be gathered and computed (a module's forward or backward). The *period* of moment ``m`` runs from
that call to the next one (the last period ends with the iteration). Gemini samples at the start of
each moment, before the layout changes, so that the gather buffers of the next operator fall into
the period they are used in (as the "Meet Gemini" design describes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kolossos.zero.gemini.memory_tracer.trace import AccessTrace

__all__ = ["MemStats"]


@dataclass(kw_only=True)
class MemStats:
    """Per-moment statistics of one training iteration on one rank.

    Example:
        >>> stats = MemStats(access_order=[(0,), (1,)], non_model_bytes=[10, 30],
        ...                  model_bytes=[100, 120])
        >>> stats.period_non_model(1), stats.max_non_model
        (30, 30)
    """

    access_order: list[tuple[int, ...]] = field(default_factory=list)
    """``access_order[m]``: ids of the chunks computed at moment ``m``."""
    non_model_bytes: list[int] = field(default_factory=list)
    """``non_model_bytes[m]``: peak device bytes of non-model data during period ``m``."""
    model_bytes: list[int] = field(default_factory=list)
    """``model_bytes[m]``: device bytes of model data (chunks) during period ``m``."""

    def __post_init__(self) -> None:
        lengths = {len(self.access_order), len(self.non_model_bytes), len(self.model_bytes)}
        if len(lengths) != 1:
            raise ValueError(
                "MemStats lists must have one entry per moment; got access_order="
                f"{len(self.access_order)}, non_model_bytes={len(self.non_model_bytes)}, "
                f"model_bytes={len(self.model_bytes)}."
            )
        if any(v < 0 for v in (*self.non_model_bytes, *self.model_bytes)):
            raise ValueError("MemStats byte counts must be >= 0.")

    @property
    def num_moments(self) -> int:
        """Number of compute moments recorded in the iteration."""
        return len(self.access_order)

    @property
    def max_non_model(self) -> int:
        """Largest non-model peak of any period (0 when nothing was recorded)."""
        return max(self.non_model_bytes, default=0)

    @property
    def max_overall(self) -> int:
        """Largest model + non-model device bytes of any period."""
        pairs = zip(self.model_bytes, self.non_model_bytes, strict=True)
        return max((m + n for m, n in pairs), default=0)

    def period_non_model(self, moment: int) -> int:
        """Return the non-model peak of period ``moment``; the overall maximum for moments the
        warm-up iteration did not have (a safe answer when iterations differ)."""
        if 0 <= moment < len(self.non_model_bytes):
            return self.non_model_bytes[moment]
        return self.max_non_model

    def trace(self) -> AccessTrace:
        """Return the access order as an :class:`AccessTrace` (next-use queries)."""
        return AccessTrace(self.access_order)

    def max_gather_bytes(self, extra_bytes: Mapping[int, int] | None = None) -> int:
        """Return the largest sum of ``extra_bytes[chunk_id]`` over the chunks of one moment.

        Args:
            extra_bytes: per chunk id, the bytes a chunk adds on the device when gathered
                (``chunk_mem - shard_mem``); ``None`` gives 0.
        """
        if extra_bytes is None:
            return 0
        return max(
            (sum(extra_bytes.get(c, 0) for c in ids) for ids in self.access_order),
            default=0,
        )
