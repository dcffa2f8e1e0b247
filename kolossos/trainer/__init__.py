"""Colossal-AI's old import path ``colossalai.trainer`` (see :mod:`kolossos.legacy.trainer`):
``from kolossos.trainer import Trainer, hooks``; ``kolossos.trainer.hooks`` re-exports
:mod:`kolossos.legacy.trainer.hooks`."""

from kolossos.legacy.trainer import Trainer
from kolossos.trainer import hooks

__all__ = ["Trainer", "hooks"]
