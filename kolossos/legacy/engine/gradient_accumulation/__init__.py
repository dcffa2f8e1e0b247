"""Gradient accumulation (``colossalai.engine.gradient_accumulation``), applied by
``initialize`` for ``gradient_accumulation = N``."""

from kolossos.legacy.engine.gradient_accumulation.accumulate import (
    GradAccumDataloader,
    GradAccumGradientHandler,
    GradAccumLrSchedulerByStep,
    GradAccumOptimizer,
    accumulate_gradient,
)

__all__ = [
    "GradAccumDataloader",
    "GradAccumGradientHandler",
    "GradAccumLrSchedulerByStep",
    "GradAccumOptimizer",
    "accumulate_gradient",
]
