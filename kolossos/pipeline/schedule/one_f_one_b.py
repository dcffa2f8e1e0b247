"""Non-interleaved schedules: GPipe and 1F1B (one chunk per rank)."""

from __future__ import annotations

from kolossos.pipeline.schedule.base import PipelineSchedule
from kolossos.pipeline.schedule.table import ScheduleTable
from kolossos.pipeline.schedule.tables import gpipe_table, one_f_one_b_table


class _SingleChunk(PipelineSchedule):
    def _check_manager(self) -> None:
        super()._check_manager()
        if self.stage_manager.num_model_chunks != 1:
            raise ValueError(
                f"{type(self).__name__} runs one model chunk per rank, the stage manager has "
                f"{self.stage_manager.num_model_chunks}; use InterleavedSchedule for more."
            )


class OneForwardOneBackwardSchedule(_SingleChunk):
    """1F1B: after ``p - r - 1`` warm-up forwards, rank ``r`` alternates one forward and one
    backward, so at most ``p - r`` micro-batches are in flight on it.

    Example:
        >>> schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=8)  # doctest: +SKIP
        >>> out = schedule.forward_backward_step(stage, iter([(x, y)]), loss_fn)  # doctest: +SKIP
        >>> out["loss"]  # on the last stage; None elsewhere  # doctest: +SKIP
    """

    name = "1f1b"

    def build_table(self, num_microbatches: int) -> ScheduleTable:
        """The 1F1B table."""
        return one_f_one_b_table(self.stage_manager.pp_size, num_microbatches)


class GPipeSchedule(_SingleChunk):
    """GPipe: all forwards, then all backwards (``m`` micro-batches in flight); the baseline
    the other schedules improve on."""

    name = "gpipe"

    def build_table(self, num_microbatches: int) -> ScheduleTable:
        """The GPipe table."""
        return gpipe_table(self.stage_manager.pp_size, num_microbatches)
