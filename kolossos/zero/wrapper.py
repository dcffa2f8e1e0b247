"""``zero_model_wrapper`` / ``zero_optim_wrapper``: ZeRO without the Booster, as the documents
use it.

``zero_model_wrapper(model, zero_stage=3, gemini_config=...)`` wraps the model into a
:class:`~kolossos.zero.gemini.GeminiDDP`; stages 1 and 2 leave the model as it is (every rank
keeps all of it) and only remember the stage. ``zero_optim_wrapper(model, optimizer, ...)`` then
builds the matching optimizer: :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer` for
stages 1/2, :class:`~kolossos.zero.gemini.GeminiOptimizer` for stage 3. Train with
``optimizer.backward(loss)``, never ``loss.backward()``.

Example:
    >>> model = zero_model_wrapper(model, zero_stage=3,
    ...                            gemini_config=dict(placement_policy="cpu", hidden_dim=768))
    >>> optimizer = zero_optim_wrapper(model, optimizer, initial_scale=2**5)
    >>> optimizer.backward(loss); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.optim import Optimizer

from kolossos.accelerator import get_accelerator
from kolossos.amp import LossScalePolicy
from kolossos.interface import OptimizerWrapper
from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer
from kolossos.zero.gemini.gemini_config import GeminiConfig
from kolossos.zero.low_level import LowLevelZeroOptimizer

__all__ = ["zero_model_wrapper", "zero_optim_wrapper"]

#: the ZeRO stage zero_model_wrapper prepared a model for, kept on the model itself
_STAGE_ATTR = "_kolossos_zero_stage"


def zero_model_wrapper(
    model: nn.Module,
    zero_stage: int = 1,
    gemini_config: dict[str, Any] | None = None,
    verbose: bool = False,
) -> nn.Module:
    """Prepare ``model`` for ZeRO stage ``zero_stage`` (Colossal-AI's signature).

    Args:
        model: the module to train.
        zero_stage: 1 or 2 (low-level ZeRO: the model is returned unchanged), or 3 (Gemini).
        gemini_config: stage 3 only: ``GeminiDDP`` options, e.g. ``dict(placement_policy='cpu',
            pin_memory=True, strict_ddp_mode=True, hidden_dim=768)``; ``device`` and
            ``mixed_precision`` (a dtype) are accepted as in Colossal-AI 0.3.
        verbose: log the chunk search and placement (stage 3).

    Returns:
        ``model`` itself (stages 1/2) or a ``GeminiDDP`` wrapping it (stage 3).

    Raises:
        ValueError: a stage other than 1, 2, 3; ``gemini_config`` with stage 1/2; a bad option.
        TypeError: an unknown ``gemini_config`` key (the message lists the accepted ones).
    """
    if isinstance(zero_stage, bool) or zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 1, 2 or 3.")
    if not isinstance(verbose, bool):
        raise TypeError(f"verbose={verbose!r} must be True or False.")
    if zero_stage in (1, 2):
        if gemini_config:
            raise ValueError(
                f"gemini_config is used by zero_stage=3 only (got zero_stage={zero_stage}); "
                "drop it or use zero_stage=3."
            )
        vars(model)[_STAGE_ATTR] = zero_stage
        return model
    options = dict(gemini_config or {})
    if verbose:
        options["verbose"] = True
    config = GeminiConfig.from_ddp_kwargs(options)
    config.check_device(get_accelerator().get_current_device())
    wrapped = GeminiDDP(model, **config.ddp_kwargs())
    vars(wrapped)[_STAGE_ATTR] = 3
    return wrapped


def zero_optim_wrapper(
    model: nn.Module,
    optimizer: Optimizer,
    initial_scale: float = 2**16,
    growth_factor: float = 2,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    min_scale: float = 1,
    max_scale: float = 2**32,
    max_norm: float = 0.0,
    norm_type: float = 2.0,
    optim_config: dict[str, Any] | None = None,
    verbose: bool = False,
) -> OptimizerWrapper:
    """Wrap ``optimizer`` for the ZeRO stage ``model`` was prepared for by
    :func:`zero_model_wrapper` (Colossal-AI's signature).

    Args:
        model: the value returned by ``zero_model_wrapper``.
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (e.g. ``HybridAdam``).
        initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
            max_scale: the fp16 dynamic loss scale.
        max_norm, norm_type: clip gradients to this global norm at every step (0: off).
        optim_config: further keyword arguments of the ZeRO optimizer (stage 1/2:
            ``LowLevelZeroOptimizer``'s, e.g. ``reduce_bucket_size``; stage 3:
            ``GeminiOptimizer``'s, e.g. ``gpu_margin_mem_ratio``).
        verbose: log loss-scale changes.

    Raises:
        ValueError: ``model`` did not come from ``zero_model_wrapper``.
    """
    stage = vars(model).get(_STAGE_ATTR)
    if stage is None:
        raise ValueError(
            "zero_optim_wrapper needs the model returned by zero_model_wrapper(model, "
            f"zero_stage=...); got a {type(model).__name__} that was not prepared."
        )
    policy = LossScalePolicy.of(locals())
    kwargs: dict[str, Any] = {**policy.as_kwargs(), "norm_type": norm_type, "verbose": verbose}
    extra = dict(optim_config or {})
    clash = sorted(set(extra) & (set(kwargs) | {"max_norm", "clip_grad_norm", "partition_grad"}))
    if clash:
        raise ValueError(
            f"optim_config repeats {', '.join(clash)}; pass these as zero_optim_wrapper's own "
            "arguments."
        )
    if stage in (1, 2):
        zero = LowLevelZeroOptimizer(
            optimizer, clip_grad_norm=max_norm, partition_grad=stage == 2, **kwargs, **extra
        )
        zero.set_param_names(model)
        return zero
    assert isinstance(model, GeminiDDP)
    return GeminiOptimizer(optimizer, model, max_norm=max_norm, **kwargs, **extra)
