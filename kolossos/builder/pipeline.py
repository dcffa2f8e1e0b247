"""Colossal-AI's old import path ``colossalai.builder.pipeline``
(see :mod:`kolossos.legacy.builder.pipeline`)."""

from kolossos.legacy.builder.pipeline import *  # noqa: F403
from kolossos.legacy.builder.pipeline import __all__  # noqa: F401
