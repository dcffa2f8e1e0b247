"""Pipeline schedules: tables of actions per rank (pure functions) run by one executor."""

from kolossos.pipeline.schedule.base import PipelineSchedule, ScheduleConfig
from kolossos.pipeline.schedule.executor import ScheduleExecutor, StepStats
from kolossos.pipeline.schedule.interleaved import InterleavedSchedule
from kolossos.pipeline.schedule.one_f_one_b import GPipeSchedule, OneForwardOneBackwardSchedule
from kolossos.pipeline.schedule.registry import SCHEDULES, build_table
from kolossos.pipeline.schedule.table import Action, ActionKind, ScheduleTable, validate_table
from kolossos.pipeline.schedule.zero_bubble import ZeroBubbleH1Schedule, ZeroBubbleVSchedule

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "GPipeSchedule",
    "InterleavedSchedule",
    "OneForwardOneBackwardSchedule",
    "PipelineSchedule",
    "ScheduleConfig",
    "ScheduleExecutor",
    "ScheduleTable",
    "StepStats",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
    "build_table",
    "create_schedule",
    "validate_table",
]

_CLASSES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls
    for cls in (
        GPipeSchedule,
        OneForwardOneBackwardSchedule,
        InterleavedSchedule,
        ZeroBubbleH1Schedule,
        ZeroBubbleVSchedule,
    )
}


def create_schedule(name: str, stage_manager: object, **kwargs: object) -> PipelineSchedule:
    """The schedule called ``name`` (``gpipe``, ``1f1b``, ``interleaved``, ``zbh1``, ``zbv``).

    Raises:
        ValueError: an unknown name.
    """
    if name not in _CLASSES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(_CLASSES)}.")
    return _CLASSES[name](stage_manager, **kwargs)  # type: ignore[arg-type]
