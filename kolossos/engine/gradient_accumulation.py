"""Colossal-AI's old import path ``colossalai.engine.gradient_accumulation``
(see :mod:`kolossos.legacy.engine.gradient_accumulation`)."""

from kolossos.legacy.engine.gradient_accumulation import *  # noqa: F403
from kolossos.legacy.engine.gradient_accumulation import __all__  # noqa: F401
