"""``ZeROGradientHandler``: let a ZeRO optimizer finish reducing its gradients."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch.nn as nn

from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler
from kolossos.legacy.registry import GRADIENT_HANDLER

__all__ = ["SyncsGradients", "ZeROGradientHandler"]


@runtime_checkable
class SyncsGradients(Protocol):
    """An optimizer that reduces its own gradients (kolossos' ZeRO optimizers)."""

    def sync_grad(self) -> None:
        """Finish every pending gradient reduction (a collective)."""


@GRADIENT_HANDLER.register_module
class ZeROGradientHandler(BaseGradientHandler):
    """Calls the ZeRO optimizer's ``sync_grad()``: gradients accumulated without communication
    are reduced to their owners before clipping and the step. ``initialize`` adds it when the
    config has a ``zero`` key and no ``gradient_handler``.

    Raises:
        TypeError: the optimizer is not a ZeRO optimizer (``LowLevelZeroOptimizer``,
            ``GeminiOptimizer``).
    """

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        if not isinstance(optimizer, SyncsGradients):
            raise TypeError(
                f"ZeROGradientHandler needs a ZeRO optimizer (with sync_grad), got "
                f"{type(optimizer).__name__}; configure zero=dict(...) in the launch config, or "
                "use DataParallelGradientHandler."
            )
        super().__init__(model, optimizer)
        self._zero: SyncsGradients = optimizer

    def handle_gradient(self) -> None:
        """Reduce what is pending (a collective over the data-parallel group, if anything)."""
        self._zero.sync_grad()
