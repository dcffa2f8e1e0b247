"""``EngineConfigError``: a launch config that ``initialize`` cannot honour."""

from __future__ import annotations

from kolossos.legacy.context import ConfigException

__all__ = ["EngineConfigError"]


class EngineConfigError(ConfigException, ValueError):
    """A launch config that ``initialize`` cannot honour (a ``ConfigException``, as Colossal-AI
    raises, and a ``ValueError``)."""
