"""Colossal-AI's module path of the interleaved 1F1B schedule
(``colossalai.pipeline.schedule.interleaved_pp``); the class lives in
:mod:`kolossos.pipeline.schedule.interleaved`."""

from kolossos.pipeline.schedule.interleaved import InterleavedSchedule

__all__ = ["InterleavedSchedule"]
