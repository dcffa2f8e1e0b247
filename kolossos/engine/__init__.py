"""Colossal-AI's old import path ``colossalai.engine`` (see :mod:`kolossos.legacy.engine`)."""

from kolossos.engine import gradient_accumulation, gradient_handler, schedule
from kolossos.legacy.engine import Engine
from kolossos.legacy.engine.gradient_handler import (
    BaseGradientHandler,
    DataParallelGradientHandler,
)

__all__ = [
    "BaseGradientHandler",
    "DataParallelGradientHandler",
    "Engine",
    "gradient_accumulation",
    "gradient_handler",
    "schedule",
]
