"""Colossal-AI's old import path ``colossalai.context.random`` (see
:mod:`kolossos.legacy.context.random`)."""

from kolossos.legacy.context.random import *  # noqa: F403
from kolossos.legacy.context.random import __all__  # noqa: F401
