"""Pipeline schedules: tables of actions per rank (pure functions) run by one executor.

Every schedule is registered once in :mod:`kolossos.pipeline.schedule.registry`
(:class:`ScheduleSpec`); :func:`build_table`, :func:`create_schedule` and the simulator read that
registration.
"""

from kolossos.pipeline.schedule.base import PipelineSchedule, ScheduleConfig, schedule_class
from kolossos.pipeline.schedule.executor import ScheduleExecutor, StepStats
from kolossos.pipeline.schedule.interleaved import InterleavedSchedule
from kolossos.pipeline.schedule.one_f_one_b import GPipeSchedule, OneForwardOneBackwardSchedule
from kolossos.pipeline.schedule.registry import (
    SCHEDULES,
    ScheduleSpec,
    build_table,
    check_num_chunks,
    register_schedule,
    schedule_names,
    schedule_spec,
    unregister_schedule,
)
from kolossos.pipeline.schedule.table import Action, ActionKind, ScheduleTable, validate_table
from kolossos.pipeline.schedule.zero_bubble_schedules import (
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
)

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
    "ScheduleSpec",
    "ScheduleTable",
    "StepStats",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
    "build_table",
    "check_num_chunks",
    "create_schedule",
    "register_schedule",
    "schedule_names",
    "schedule_spec",
    "unregister_schedule",
    "validate_table",
]


def create_schedule(name: str, stage_manager: object, **kwargs: object) -> PipelineSchedule:
    """A runner for registered schedule ``name`` (see :func:`schedule_names`).

    The schedule's own class when it has one (``gpipe``: :class:`GPipeSchedule`, ``1f1b``,
    ``interleaved``, ``zbh1``, ``zbv``: :class:`ZeroBubbleVSchedule`, which also takes ``costs``),
    otherwise :class:`PipelineSchedule` running that registration.

    Args:
        name: a registered schedule.
        stage_manager: this rank's :class:`~kolossos.pipeline.PipelineStageManager`.
        **kwargs: the class's other arguments (``num_microbatches``, ``microbatch_size``, ...).

    Raises:
        ValueError: an unknown name, or arguments the schedule rejects.
    """
    cls = schedule_class(name)
    if cls is PipelineSchedule:
        kwargs["schedule"] = name
    return cls(stage_manager, **kwargs)  # type: ignore[arg-type]
