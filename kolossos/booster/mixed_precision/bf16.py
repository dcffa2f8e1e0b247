"""``BF16MixedPrecision``: autocast to bfloat16, fp32 parameters, no loss scaling."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.booster.mixed_precision.mixed_precision_base import (
    AutocastCriterion,
    AutocastModel,
    Criterion,
    MixedPrecision,
    as_optimizer_wrapper,
)
from kolossos.interface import OptimizerWrapper


class BF16MixedPrecision(MixedPrecision):
    """Forward and loss under ``torch.autocast(dtype=bfloat16)``; parameters, gradients and
    optimizer states stay fp32. bf16 has fp32's exponent range, so no loss scale is needed.

    Example:
        >>> booster = Booster(mixed_precision="bf16", plugin=TorchDDPPlugin())
    """

    name = "bf16"

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Criterion | None]:
        wrapped_opt = None if optimizer is None else as_optimizer_wrapper(optimizer)
        wrapped_crit = None if criterion is None else AutocastCriterion(criterion, torch.bfloat16)
        return AutocastModel(model, torch.bfloat16), wrapped_opt, wrapped_crit
