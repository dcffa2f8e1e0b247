"""``BaseGradientHandler``: what the Engine calls between backward and the optimizer step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch.nn as nn

__all__ = ["BaseGradientHandler"]


class BaseGradientHandler(ABC):
    """Reduces gradients across process groups before ``engine.step()`` updates parameters.

    Subclass it, implement :meth:`handle_gradient`, register the class with
    ``@GRADIENT_HANDLER.register_module`` and name it in the config:
    ``gradient_handler = [dict(type="MyHandler", **kwargs)]`` (the extra keys reach the
    constructor after ``model`` and ``optimizer``).

    Args:
        model: the model whose gradients are handled (as the Engine holds it).
        optimizer: the Engine's optimizer.

    Example:
        >>> @GRADIENT_HANDLER.register_module
        ... class MyHandler(BaseGradientHandler):
        ...     def handle_gradient(self):
        ...         for p in self._model.parameters():
        ...             ...  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        self._model = model
        self._optimizer = optimizer

    @abstractmethod
    def handle_gradient(self) -> None:
        """Reduce the gradients (a collective on the handler's group)."""
