"""Colossal-AI's old import path ``colossalai.core``: ``from kolossos.core import
global_context as gpc`` (the legacy global context, :mod:`kolossos.legacy.core`)."""

from kolossos.legacy.core import global_context

__all__ = ["global_context"]
