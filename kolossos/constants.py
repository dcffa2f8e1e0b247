"""Colossal-AI's old import path ``colossalai.constants`` (the same ``INITIALIZER_MAPPING``
dict as :mod:`kolossos.legacy.constants`, so adding a mode here is seen everywhere)."""

from kolossos.legacy.constants import *  # noqa: F403
from kolossos.legacy.constants import __all__  # noqa: F401
