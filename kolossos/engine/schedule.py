"""Colossal-AI's old import path ``colossalai.engine.schedule``
(see :mod:`kolossos.legacy.engine.schedule`)."""

from kolossos.legacy.engine.schedule import *  # noqa: F403
from kolossos.legacy.engine.schedule import __all__  # noqa: F401
