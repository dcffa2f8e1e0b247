"""``FP16TorchMixedPrecision``: autocast to fp16 with a dynamic loss scale (fp32 parameters)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.amp import DynamicGradScaler, LossScalePolicy
from kolossos.amp.loss_scaled_optimizer import LossScaledOptimizer
from kolossos.booster.mixed_precision.mixed_precision_base import (
    AutocastCriterion,
    AutocastModel,
    Criterion,
    MixedPrecision,
    as_optimizer_wrapper,
    unwrapped_optimizer,
)
from kolossos.interface import OptimizerWrapper


class FP16TorchMixedPrecision(MixedPrecision):
    """PyTorch-style AMP: parameters and optimizer stay fp32, forward and loss run under
    ``torch.autocast(dtype=float16)``, gradients are scaled and checked for overflow.

    An overflow on any rank skips the step on every rank and multiplies the scale by
    ``backoff_factor``; ``growth_interval`` good steps in a row multiply it by ``growth_factor``
    (``torch.amp.GradScaler``'s rule, implemented by :class:`kolossos.amp.DynamicGradScaler` with
    ``hysteresis=1``).

    Args:
        init_scale: initial loss scale.
        growth_factor: factor applied after ``growth_interval`` good steps (> 1).
        backoff_factor: factor applied on overflow (between 0 and 1).
        growth_interval: good steps between growths.
        enabled: ``False`` turns this into plain fp32 training.

    Example:
        >>> booster = Booster(mixed_precision=FP16TorchMixedPrecision(init_scale=2**12))
    """

    name = "fp16"

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.loss_scale = LossScalePolicy(
            initial_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=1,
            min_scale=2.0**-24,  # torch's GradScaler has no floor; keep the scale representable
            max_scale=2.0**64,
        )  # validated now, before any model is touched

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Criterion | None]:
        if not self.enabled:
            plain = None if optimizer is None else as_optimizer_wrapper(optimizer)
            return model, plain, criterion
        wrapped_model = AutocastModel(model, torch.float16)
        wrapped_opt = None
        if optimizer is not None:
            scaler = DynamicGradScaler.from_policy(self.loss_scale)
            wrapped_opt = LossScaledOptimizer(unwrapped_optimizer(optimizer), scaler)
        wrapped_crit = None if criterion is None else AutocastCriterion(criterion, torch.float16)
        return wrapped_model, wrapped_opt, wrapped_crit
