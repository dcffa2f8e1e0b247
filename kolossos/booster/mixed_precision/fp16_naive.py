"""``FP16NaiveMixedPrecision``: an fp16 model with fp32 master weights and a dynamic loss scale."""

from __future__ import annotations

import torch.nn as nn
from torch.optim import Optimizer

from kolossos.amp import DynamicGradScaler, LossScalePolicy
from kolossos.amp.fp16_module import FP16Module
from kolossos.amp.loss_scaled_optimizer import LossScaledOptimizer
from kolossos.booster.mixed_precision.mixed_precision_base import (
    Criterion,
    MixedPrecision,
    unwrapped_optimizer,
)
from kolossos.interface import OptimizerWrapper


class FP16NaiveMixedPrecision(MixedPrecision):
    """The whole model in fp16 (parameters, activations, gradients), fp32 master weights in the
    optimizer, and a dynamic loss scale with hysteresis (like apex O2 / Megatron).

    Args:
        log_num_zeros_in_grad: count zero gradient elements every step
            (``optimizer.num_zeros_in_grad``; logged on rank 0 when ``verbose``).
        initial_scale, min_scale, max_scale, growth_factor, backoff_factor, growth_interval,
            hysteresis: the loss-scale rule of :class:`kolossos.amp.DynamicGradScaler`.
        verbose: log every change of the loss scale.
        keep_batchnorm_fp32: keep BatchNorm layers in fp32.
        master_weights: keep fp32 master copies (``False``: pure fp16, like apex O3).

    The positional order follows Colossal-AI's (``verbose`` seventh); the rest are keyword-only.

    Example:
        >>> booster = Booster(mixed_precision=FP16NaiveMixedPrecision(initial_scale=2**16))
    """

    name = "fp16_naive"

    def __init__(
        self,
        log_num_zeros_in_grad: bool = False,
        initial_scale: float = 2**32,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        verbose: bool = False,
        *,
        min_scale: float = 1,
        growth_interval: int = 1000,
        keep_batchnorm_fp32: bool = False,
        master_weights: bool = True,
    ) -> None:
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.verbose = verbose
        self.keep_batchnorm_fp32 = keep_batchnorm_fp32
        self.master_weights = master_weights
        self.loss_scale = LossScalePolicy.of(locals())  # validated now, before any model is touched

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Criterion | None]:
        wrapped_model = FP16Module(model, keep_batchnorm_fp32=self.keep_batchnorm_fp32)
        wrapped_opt = None
        if optimizer is not None:
            scaler = DynamicGradScaler.from_policy(self.loss_scale, self.verbose)
            wrapped_opt = LossScaledOptimizer(
                unwrapped_optimizer(optimizer),
                scaler,
                master_weights=self.master_weights,
                count_zeros=self.log_num_zeros_in_grad,
                verbose=self.verbose,
            )
        return wrapped_model, wrapped_opt, criterion
