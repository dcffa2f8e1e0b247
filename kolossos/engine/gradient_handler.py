"""Colossal-AI's old import path ``colossalai.engine.gradient_handler``
(see :mod:`kolossos.legacy.engine.gradient_handler`)."""

from kolossos.legacy.engine.gradient_handler import (
    BaseGradientHandler,
    DataParallelGradientHandler,
)

__all__ = ["BaseGradientHandler", "DataParallelGradientHandler"]
