"""The legacy Engine (``colossalai.engine``): :class:`Engine`, the gradient handlers, gradient
accumulation and the step schedules; :func:`kolossos.legacy.initialize` builds an Engine from
the launch config. Also importable as ``kolossos.engine``. See ``docs/legacy.md``."""

from kolossos.legacy.engine import gradient_accumulation, gradient_handler, schedule
from kolossos.legacy.engine.engine import Engine
from kolossos.legacy.engine.gradient_handler import BaseGradientHandler

__all__ = [
    "BaseGradientHandler",
    "Engine",
    "gradient_accumulation",
    "gradient_handler",
    "schedule",
]
