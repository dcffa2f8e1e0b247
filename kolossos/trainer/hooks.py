"""Colossal-AI's old import path ``colossalai.trainer.hooks`` (see
:mod:`kolossos.legacy.trainer.hooks`)."""

from kolossos.legacy.trainer.hooks import *  # noqa: F403
from kolossos.legacy.trainer.hooks import __all__  # noqa: F401
