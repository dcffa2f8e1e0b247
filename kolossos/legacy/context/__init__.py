"""Colossal-AI's legacy context (``colossalai.context``): ``Config``, ``ParallelMode``,
``ParallelContext``, the process-group initializers and the per-mode random streams."""

from kolossos.legacy.context import random
from kolossos.legacy.context.config import Config, ConfigException
from kolossos.legacy.context.parallel_context import ParallelContext
from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.context.process_group_initializer import ProcessGroupInitializer

__all__ = [
    "Config",
    "ConfigException",
    "ParallelContext",
    "ParallelMode",
    "ProcessGroupInitializer",
    "random",
]
