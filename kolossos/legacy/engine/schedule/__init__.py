"""Step schedules (``colossalai.engine.schedule``): :class:`NonPipelineSchedule`, the pipeline
schedules :class:`PipelineSchedule` (1F1B) and :class:`InterleavedPipelineSchedule`, and
:class:`BaseSchedule` to write your own. :func:`build_schedule` picks one from the config."""

from kolossos.legacy.engine.schedule.base import BaseSchedule
from kolossos.legacy.engine.schedule.interleaved import InterleavedPipelineSchedule
from kolossos.legacy.engine.schedule.non_pipeline import NonPipelineSchedule
from kolossos.legacy.engine.schedule.pipeline import PipelineSchedule
from kolossos.legacy.engine.schedule.select import build_schedule

__all__ = [
    "BaseSchedule",
    "InterleavedPipelineSchedule",
    "NonPipelineSchedule",
    "PipelineSchedule",
    "build_schedule",
]
