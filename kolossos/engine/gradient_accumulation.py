"""Colossal-AI's old import path ``colossalai.engine.gradient_accumulation``
(see :mod:`kolossos.legacy.engine.gradient_accumulation`)."""

from kolossos.legacy.engine.gradient_accumulation import (
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
