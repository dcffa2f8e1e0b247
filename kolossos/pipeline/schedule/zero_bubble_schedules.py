"""Zero-bubble runners: ZB-H1 and ZB-V (tables in :mod:`kolossos.pipeline.schedule.zero_bubble`,
registered in :mod:`kolossos.pipeline.schedule.registry`)."""

from __future__ import annotations

from typing import Any

from kolossos.pipeline.schedule.base import PipelineSchedule
from kolossos.pipeline.schedule.table import ScheduleTable
from kolossos.pipeline.schedule.zero_bubble import zbv_table
from kolossos.pipeline.stage_manager import PipelineStageManager


class ZeroBubbleH1Schedule(PipelineSchedule):
    """ZB-H1 (one chunk per rank): 1F1B with the weight-gradient halves of the backwards moved
    into the cool-down bubble; same peak activation memory as 1F1B's rank 0."""

    name = "zbh1"


class ZeroBubbleVSchedule(PipelineSchedule):
    """ZB-V (``zbv``): two chunks per rank in the ``v`` layout (rank 0 holds the first and the
    last stage), split backwards, near-zero bubble when forward, input-gradient and
    weight-gradient costs are similar. The stage manager needs ``num_model_chunks=2,
    layout="v"``."""

    name = "zbv"

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        *,
        costs: tuple[float, float, float] = (1.0, 1.0, 1.0),
        **kwargs: Any,
    ) -> None:
        """Args as :class:`PipelineSchedule`, plus ``costs``: the relative durations of ``F``,
        ``B`` (input gradient) and ``W`` the table is planned for (e.g. measured by the executor:
        ``last_stats.timeline``); the same on every rank.

        Raises:
            ValueError: costs that are not three positive numbers.
        """
        zbv_table(1, 1, costs)  # validate before any communication
        self.costs = costs
        super().__init__(stage_manager, num_microbatches, microbatch_size, **kwargs)

    def build_table(self, num_microbatches: int) -> ScheduleTable:
        """The ZB-V table planned for ``costs`` (the registered builder plans for equal costs)."""
        return zbv_table(self.stage_manager.pp_size, num_microbatches, self.costs)
