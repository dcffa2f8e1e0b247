"""Colossal-AI's old import path ``colossalai.engine.gradient_handler``
(see :mod:`kolossos.legacy.engine.gradient_handler`)."""

from kolossos.legacy.engine.gradient_handler import *  # noqa: F403
from kolossos.legacy.engine.gradient_handler import __all__  # noqa: F401
