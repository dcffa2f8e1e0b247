"""The ``MixedPrecision`` contract: a recipe that wraps model, optimizer and criterion."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.accelerator import get_accelerator
from kolossos.interface import ModelWrapper, OptimizerWrapper

Criterion = Callable[..., torch.Tensor]


class MixedPrecision(ABC):
    """A mixed-precision recipe applied by the Booster before the plugin wraps the model.

    ``configure`` returns the wrapped ``(model, optimizer, criterion)``; ``optimizer`` and
    ``criterion`` may be ``None``.
    """

    #: the name used in ``Booster(mixed_precision=...)`` strings
    name: str = ""

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Criterion | None]:
        """Wrap the objects for this precision."""


class AutocastModel(ModelWrapper):
    """Runs the wrapped module's forward under ``torch.autocast`` on the accelerator's device type.

    Args:
        module: the model.
        dtype: the low-precision compute dtype (``torch.float16`` or ``torch.bfloat16``).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(module)
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=get_accelerator().amp_device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class AutocastCriterion:
    """Runs a loss function under ``torch.autocast`` too, so autocast's fp32 list (softmax, log,
    cross-entropy) applies to the loss as it does inside the model."""

    def __init__(self, criterion: Criterion, dtype: torch.dtype) -> None:
        self.criterion = criterion
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast(device_type=get_accelerator().amp_device_type, dtype=self.dtype):
            return self.criterion(*args, **kwargs)


def as_optimizer_wrapper(optimizer: Optimizer | OptimizerWrapper) -> OptimizerWrapper:
    """``optimizer`` itself when already wrapped, else a plain :class:`OptimizerWrapper`."""
    return optimizer if isinstance(optimizer, OptimizerWrapper) else OptimizerWrapper(optimizer)


def unwrapped_optimizer(optimizer: Optimizer | OptimizerWrapper) -> Optimizer:
    """The ``torch.optim.Optimizer`` inside ``optimizer``."""
    return optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
