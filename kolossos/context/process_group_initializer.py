"""Colossal-AI's old import path ``colossalai.context.process_group_initializer``."""

from kolossos.legacy.context.process_group_initializer import *  # noqa: F403
from kolossos.legacy.context.process_group_initializer import __all__  # noqa: F401
