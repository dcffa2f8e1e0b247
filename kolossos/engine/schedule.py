"""Colossal-AI's old import path ``colossalai.engine.schedule``
(see :mod:`kolossos.legacy.engine.schedule`)."""

from kolossos.legacy.engine.schedule import BaseSchedule, NonPipelineSchedule

__all__ = ["BaseSchedule", "NonPipelineSchedule"]
