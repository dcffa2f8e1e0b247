"""``convert_to_amp`` and its three modes: the legacy AMP entry points, carried out by the
Booster's mixed-precision recipes (:mod:`kolossos.booster.mixed_precision`).

=================  ===========================================  =================================
mode               Colossal-AI                                  kolossos recipe
=================  ===========================================  =================================
``AMP_TYPE.TORCH`` ``torch.cuda.amp`` model/optimizer/loss       :class:`FP16TorchMixedPrecision`
``AMP_TYPE.NAIVE`` fp16 model, fp32 master weights               :class:`FP16NaiveMixedPrecision`
``AMP_TYPE.APEX``  NVIDIA apex                                  :class:`FP16ApexMixedPrecision`
                                                                 (one of the above, with a warning)
=================  ===========================================  =================================
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer

from kolossos.booster.mixed_precision import (
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
)
from kolossos.booster.mixed_precision.mixed_precision_base import Criterion
from kolossos.interface import OptimizerWrapper
from kolossos.legacy.amp.amp_type import AMP_TYPE, parse_amp_mode

__all__ = [
    "build_amp_recipe",
    "convert_to_amp",
    "convert_to_apex_amp",
    "convert_to_naive_amp",
    "convert_to_torch_amp",
]

_RECIPES: dict[AMP_TYPE, type[MixedPrecision]] = {
    AMP_TYPE.TORCH: FP16TorchMixedPrecision,
    AMP_TYPE.NAIVE: FP16NaiveMixedPrecision,
    AMP_TYPE.APEX: FP16ApexMixedPrecision,
}
#: NAIVE-only keys of Colossal-AI's config that are not recipe arguments
_NAIVE_EXTRA = ("dynamic_grad_scale", "clip_grad_norm")


def build_amp_recipe(mode: Any, amp_config: Mapping[str, Any] | None = None) -> MixedPrecision:
    """The validated recipe for ``mode`` with ``amp_config``'s keyword arguments (touches no
    model and no process group, so a bad config fails before any collective).

    ``NAIVE`` also accepts Colossal-AI's ``dynamic_grad_scale=False`` (a constant loss scale of
    ``initial_scale``); its ``clip_grad_norm`` belongs to the Engine (the top-level
    ``clip_grad_norm`` key), and is refused here.

    Raises:
        ValueError: an unknown mode, or a bad value of a known key.
        TypeError: a key the mode does not take (the message lists the accepted ones).
        NotImplementedError: ``clip_grad_norm`` inside a NAIVE config.
    """
    amp_mode = parse_amp_mode(mode)
    kwargs = dict(amp_config or {})
    kwargs.pop("mode", None)
    recipe = _RECIPES[amp_mode]
    dynamic = True
    if amp_mode is AMP_TYPE.NAIVE:
        dynamic = bool(kwargs.pop("dynamic_grad_scale", True))
        if kwargs.pop("clip_grad_norm", 0.0):
            raise NotImplementedError(
                "fp16=dict(mode=AMP_TYPE.NAIVE, clip_grad_norm=...) is not taken here: set the "
                "top-level config key clip_grad_norm (the Engine clips after unscaling), or call "
                "optimizer.clip_grad_by_norm(max_norm) before optimizer.step()."
            )
    accepted = [p for p in inspect.signature(recipe.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        extra = list(_NAIVE_EXTRA) if amp_mode is AMP_TYPE.NAIVE else []
        raise TypeError(
            f"fp16 mode AMP_TYPE.{amp_mode.name} does not take {', '.join(unknown)}; its keys "
            f"are: {', '.join(accepted + extra)}."
        )
    if not dynamic:
        scale = kwargs.get("initial_scale", 2**32)
        kwargs.update(min_scale=scale, max_scale=scale)  # a scale that never moves
    return recipe(**kwargs)


def convert_to_amp(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper,
    criterion: Criterion | None,
    mode: AMP_TYPE,
    amp_config: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, OptimizerWrapper, Criterion | None]:
    """Wrap model, optimizer and criterion for the AMP ``mode``.

    Args:
        model: the model (NAIVE converts it to fp16 in place).
        optimizer: its optimizer.
        criterion: the loss function (TORCH runs it under autocast; the others leave it).
        mode: an :class:`AMP_TYPE` (or its value, ``"torch"``...).
        amp_config: the mode's keyword arguments (CHECKLIST §7), e.g. ``dict(init_scale=2**10)``.

    Returns:
        ``(model, optimizer, criterion)``; the optimizer scales the loss in ``backward``, unscales
        and checks for overflow in ``step`` (a step overflowing on any rank is skipped on all).

    Raises:
        ValueError, TypeError: see :func:`build_amp_recipe`.

    Example:
        >>> model, optimizer, criterion = convert_to_amp(
        ...     model, optimizer, criterion, AMP_TYPE.TORCH, dict(init_scale=2**12)
        ... )  # doctest: +SKIP
    """
    recipe = build_amp_recipe(mode, amp_config)
    wrapped, optim, crit = recipe.configure(model, optimizer, criterion)
    assert optim is not None  # an optimizer went in
    return wrapped, optim, crit


def convert_to_torch_amp(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper,
    criterion: Criterion | None = None,
    amp_config: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, OptimizerWrapper, Criterion | None]:
    """:func:`convert_to_amp` with ``AMP_TYPE.TORCH`` (keys: ``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``enabled``)."""
    return convert_to_amp(model, optimizer, criterion, AMP_TYPE.TORCH, amp_config)


def convert_to_naive_amp(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper,
    amp_config: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, OptimizerWrapper]:
    """:func:`convert_to_amp` with ``AMP_TYPE.NAIVE``; returns ``(model, optimizer)``."""
    wrapped, optim, _ = convert_to_amp(model, optimizer, None, AMP_TYPE.NAIVE, amp_config)
    return wrapped, optim


def convert_to_apex_amp(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper,
    amp_config: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, OptimizerWrapper]:
    """:func:`convert_to_amp` with ``AMP_TYPE.APEX`` (apex's options mapped onto a kolossos
    recipe, with a warning); returns ``(model, optimizer)``."""
    wrapped, optim, _ = convert_to_amp(model, optimizer, None, AMP_TYPE.APEX, amp_config)
    return wrapped, optim
