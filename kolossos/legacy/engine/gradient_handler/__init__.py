"""Gradient handlers (``colossalai.engine.gradient_handler``): the objects named by the
``gradient_handler`` config key, run by ``engine.step()`` before the optimizer step.
:class:`DataParallelGradientHandler` is registered in ``GRADIENT_HANDLER``; register your own
:class:`BaseGradientHandler` subclass the same way."""

from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler
from kolossos.legacy.engine.gradient_handler.data_parallel import DataParallelGradientHandler

__all__ = ["BaseGradientHandler", "DataParallelGradientHandler"]
