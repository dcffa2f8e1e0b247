"""Colossal-AI's old import path ``colossalai.context`` (see :mod:`kolossos.legacy.context`)."""

from kolossos.legacy.context import (
    Config,
    ConfigException,
    ParallelContext,
    ParallelMode,
    ProcessGroupInitializer,
    random,
)

__all__ = [
    "Config",
    "ConfigException",
    "ParallelContext",
    "ParallelMode",
    "ProcessGroupInitializer",
    "random",
]
