"""MemStatsCollector: records one warm-up iteration into :class:`MemStats`.

The placement policy drives it. At each moment it calls :meth:`MemStatsCollector.begin_moment`
*before* changing the layout (this closes the previous period and samples its non-model peak) and
:meth:`MemStatsCollector.end_moment` with the model-data bytes the device will hold during the new
period. :meth:`MemStatsCollector.finish` closes the last period at the end of the iteration.
Without a sampler only the access order is recorded (non-model bytes read 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from kolossos.zero.gemini.memory_tracer.memstats import MemStats
from kolossos.zero.gemini.memory_tracer.sampler import MemorySampler

__all__ = ["MemStatsCollector"]


class MemStatsCollector:
    """Collects per-moment non-model memory and chunk access order for one iteration.

    Args:
        sampler: measures non-model memory; ``None`` records the access order only.

    Example:
        >>> collector = MemStatsCollector(TrackerSampler())
        >>> collector.begin_moment([0, 1]); collector.end_moment(model_bytes=4096)
        >>> ...  # compute
        >>> stats = collector.finish()
    """

    def __init__(self, sampler: MemorySampler | None) -> None:
        self._sampler = sampler
        self._order: list[tuple[int, ...]] = []
        self._non_model: list[int] = []
        self._model: list[int] = []
        self._open = False  # a moment's period is running

    @property
    def collecting(self) -> bool:
        """Whether an iteration is being recorded (a moment has begun and not finished)."""
        return bool(self._order)

    @property
    def num_moments(self) -> int:
        """Moments recorded so far in this iteration."""
        return len(self._order)

    def begin_moment(self, chunk_ids: Sequence[int], *, model_bytes: int | None = None) -> None:
        """Close the running period (sampling its non-model peak) and open moment ``n``.

        Args:
            chunk_ids: ids of the chunks about to be computed.
            model_bytes: device model-data bytes now, at the end of the running period (chunks
                released during it make this smaller than at its start).
        """
        if self._open:
            self._close_period(model_bytes)
        elif not self._order and self._sampler is not None:
            self._sampler.start()
        self._order.append(tuple(chunk_ids))

    def end_moment(self, *, model_bytes: int) -> None:
        """Record the device model-data bytes of the period that starts now."""
        if len(self._model) != len(self._order) - 1:
            raise RuntimeError("MemStatsCollector.end_moment() must follow begin_moment().")
        self._model.append(int(model_bytes))
        self._open = True

    def _close_period(self, model_now: int | None) -> None:
        # Model data only shrinks within a period (gathers happen at its start), so its smallest
        # value is the one at the end: subtracting it never under-estimates non-model memory.
        model = self._model[-1] if model_now is None else min(self._model[-1], model_now)
        non_model = self._sampler.sample(model) if self._sampler is not None else 0
        self._non_model.append(non_model)
        self._open = False

    def finish(self, *, model_bytes: int | None = None) -> MemStats:
        """Close the last period, stop sampling and return the iteration's statistics.

        Args:
            model_bytes: device model-data bytes now (see :meth:`begin_moment`).
        """
        try:
            if self._open:
                self._close_period(model_bytes)
        finally:
            if self._sampler is not None:
                self._sampler.stop()
        stats = MemStats(
            access_order=self._order, non_model_bytes=self._non_model, model_bytes=self._model
        )
        self._order, self._non_model, self._model = [], [], []
        return stats

    def abort(self) -> None:
        """Drop a partial recording and stop sampling (e.g. after an exception)."""
        if self._sampler is not None:
            self._sampler.stop()
        self._order, self._non_model, self._model, self._open = [], [], [], False
