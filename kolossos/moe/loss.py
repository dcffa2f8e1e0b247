"""``MoeLoss`` and ``MoeCrossEntropyLoss``: a criterion plus the MoE load-balancing loss.

The MoE layers of a forward pass record their load-balancing losses in
:data:`~kolossos.moe.context.MOE_CONTEXT`; the criterion adds ``aux_weight`` times their sum and
clears them, so every step starts afresh even when the model does not call
``MOE_CONTEXT.reset_loss()`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from kolossos.moe.context import MOE_CONTEXT

__all__ = ["MoeCrossEntropyLoss", "MoeLoss"]


class MoeLoss(nn.Module):
    """``loss_fn(*args, **kwargs)`` (built once) plus ``aux_weight`` × the MoE auxiliary loss.

    Args:
        aux_weight: the weight of the load-balancing loss.
        loss_fn: the criterion's class (e.g. ``nn.CrossEntropyLoss``).
        *args, **kwargs: its constructor's arguments (e.g. ``label_smoothing=0.1``).

    Example:
        >>> criterion = MoeLoss(aux_weight=0.01, loss_fn=nn.CrossEntropyLoss, label_smoothing=0.1)
        >>> MOE_CONTEXT.reset_loss(); MOE_CONTEXT.add_loss(torch.tensor(2.0))
        >>> logits, labels = torch.zeros(2, 3), torch.tensor([0, 1])
        >>> extra = criterion(logits, labels) - nn.CrossEntropyLoss()(logits, labels)
        >>> round(extra.item(), 4)
        0.02
    """

    def __init__(self, aux_weight: float, loss_fn: Callable[..., Any], *args: Any, **kwargs: Any):
        super().__init__()
        if not callable(loss_fn):
            raise TypeError(f"MoeLoss(loss_fn={loss_fn!r}): pass the criterion class.")
        self.loss_fn = loss_fn(*args, **kwargs)
        self.aux_weight = aux_weight

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The criterion's loss plus ``aux_weight`` × the recorded auxiliary losses."""
        main: torch.Tensor = self.loss_fn(*args, **kwargs)
        return main + self.aux_weight * MOE_CONTEXT.pop_loss()


class MoeCrossEntropyLoss(MoeLoss):
    """``nn.CrossEntropyLoss(*args, **kwargs)`` plus ``aux_weight`` × the auxiliary loss."""

    def __init__(self, aux_weight: float = 0.01, *args: Any, **kwargs: Any) -> None:
        super().__init__(aux_weight, nn.CrossEntropyLoss, *args, **kwargs)
