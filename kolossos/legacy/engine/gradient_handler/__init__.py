"""Gradient handlers (``colossalai.engine.gradient_handler``): the objects named by the
``gradient_handler`` config key, run by ``engine.step()`` before the optimizer step.
:class:`DataParallelGradientHandler`, :class:`ZeROGradientHandler` and
:class:`MoeGradientHandler` are registered in ``GRADIENT_HANDLER``; register your own
:class:`BaseGradientHandler` subclass the same way."""

from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler
from kolossos.legacy.engine.gradient_handler.data_parallel import DataParallelGradientHandler
from kolossos.legacy.engine.gradient_handler.moe import MoeGradientHandler
from kolossos.legacy.engine.gradient_handler.pipeline_shared import (
    PipelineSharedModuleGradientHandler,
)
from kolossos.legacy.engine.gradient_handler.sequence_parallel import (
    SequenceParallelGradientHandler,
)
from kolossos.legacy.engine.gradient_handler.zero import ZeROGradientHandler

__all__ = [
    "BaseGradientHandler",
    "DataParallelGradientHandler",
    "MoeGradientHandler",
    "PipelineSharedModuleGradientHandler",
    "SequenceParallelGradientHandler",
    "ZeROGradientHandler",
]
