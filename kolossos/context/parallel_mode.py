"""Colossal-AI's old import path ``colossalai.context.parallel_mode``."""

from kolossos.legacy.context.parallel_mode import ParallelMode

__all__ = ["ParallelMode"]
