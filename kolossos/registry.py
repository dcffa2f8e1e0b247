"""Colossal-AI's old import path ``colossalai.registry`` (see :mod:`kolossos.legacy.registry`)."""

from kolossos.legacy.registry import *  # noqa: F403
from kolossos.legacy.registry import __all__  # noqa: F401
