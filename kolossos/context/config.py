"""Colossal-AI's old import path ``colossalai.context.config``."""

from kolossos.legacy.context.config import Config, ConfigException

__all__ = ["Config", "ConfigException"]
