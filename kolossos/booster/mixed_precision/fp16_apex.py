"""``FP16ApexMixedPrecision``: apex's AMP interface, carried out by kolossos's own recipes.

NVIDIA apex is not a dependency (it needs a CUDA build and does not run on CPU). Its optimisation
levels map onto equivalent kolossos recipes, with one warning saying so:

=========  ==================================================  ===============================
opt_level  apex                                                kolossos
=========  ==================================================  ===============================
``O0``     fp32                                                no mixed precision
``O1``     patched functions in fp16, fp32 weights             :class:`FP16TorchMixedPrecision`
``O2``     fp16 model, fp32 master weights, fp32 batch norm    :class:`FP16NaiveMixedPrecision`
``O3``     pure fp16, no master weights                        naive, ``master_weights=False``
=========  ==================================================  ===============================
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.amp.fp16_module import FP16Module
from kolossos.booster.mixed_precision.fp16_naive import FP16NaiveMixedPrecision
from kolossos.booster.mixed_precision.fp16_torch import FP16TorchMixedPrecision
from kolossos.booster.mixed_precision.mixed_precision_base import (
    Criterion,
    MixedPrecision,
    as_optimizer_wrapper,
)
from kolossos.interface import OptimizerWrapper

_LEVELS = ("O0", "O1", "O2", "O3")


class FP16ApexMixedPrecision(MixedPrecision):
    """apex-style AMP arguments, mapped onto kolossos recipes (see the module doc).

    Honoured: ``opt_level``, ``keep_batchnorm_fp32`` (O2/O3), ``master_weights`` (O2/O3),
    ``loss_scale`` (``"dynamic"`` or a number: a constant scale), ``min_loss_scale``,
    ``max_loss_scale``, ``cast_model_outputs``. Rejected with a message: ``num_losses != 1``,
    ``cast_model_type`` other than fp16, ``patch_torch_functions=False`` at O1.

    Raises:
        ValueError: an unknown ``opt_level`` or an unsupported combination.
    """

    name = "fp16_apex"

    def __init__(
        self,
        opt_level: str = "O1",
        cast_model_type: torch.dtype | None = None,
        patch_torch_functions: bool | None = None,
        keep_batchnorm_fp32: bool | str | None = None,
        master_weights: bool | None = None,
        loss_scale: float | str | None = None,
        cast_model_outputs: torch.dtype | None = None,
        num_losses: int = 1,
        verbosity: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = 2.0**24,
    ) -> None:
        if opt_level not in _LEVELS:
            raise ValueError(f"opt_level={opt_level!r} must be one of {', '.join(_LEVELS)}.")
        if num_losses != 1:
            raise ValueError(f"num_losses={num_losses}: only one loss per step is supported.")
        if cast_model_type not in (None, torch.float16):
            raise ValueError(f"cast_model_type={cast_model_type} is not supported; use fp16.")
        if opt_level == "O1" and patch_torch_functions is False:
            raise ValueError("opt_level='O1' is defined by patched functions (autocast).")
        self.opt_level = opt_level
        dynamic = loss_scale in (None, "dynamic")
        initial = 2.0**16 if dynamic else float(loss_scale)  # type: ignore[arg-type]
        max_scale = float(max_loss_scale) if max_loss_scale is not None else 2.0**64
        min_scale = float(min_loss_scale) if min_loss_scale is not None else 2.0**-24
        initial = min(initial, max_scale)
        self._inner: MixedPrecision | None
        if opt_level == "O0":
            self._inner = None
        elif opt_level == "O1":
            torch_amp = FP16TorchMixedPrecision(init_scale=initial, growth_interval=2000)
            # a fixed scale never grows
            low, high = (min_scale, max_scale) if dynamic else (initial, initial)
            torch_amp.loss_scale = dataclasses.replace(
                torch_amp.loss_scale, min_scale=low, max_scale=high
            )
            self._inner = torch_amp
        else:
            keep_bn = keep_batchnorm_fp32 in (True, "True") or (
                keep_batchnorm_fp32 is None and opt_level == "O2"
            )
            naive = FP16NaiveMixedPrecision(
                initial_scale=initial,
                min_scale=initial if not dynamic else min_scale,
                max_scale=initial if not dynamic else max_scale,
                hysteresis=1,
                growth_interval=2000,
                keep_batchnorm_fp32=keep_bn,
                master_weights=master_weights if master_weights is not None else opt_level == "O2",
                verbose=verbosity > 1,
            )
            self._inner = naive
        self.cast_model_outputs = cast_model_outputs
        warnings.warn(
            f"apex is not used: FP16ApexMixedPrecision(opt_level={opt_level!r}) runs kolossos's "
            f"{type(self._inner).__name__ if self._inner else 'fp32'} recipe instead.",
            UserWarning,
            stacklevel=2,
        )

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Criterion | None]:
        if self._inner is None:
            return model, None if optimizer is None else as_optimizer_wrapper(optimizer), criterion
        model, optim, crit = self._inner.configure(model, optimizer, criterion)
        if self.cast_model_outputs is not None and isinstance(model, FP16Module):
            model.output_dtype = self.cast_model_outputs
        return model, optim, crit
