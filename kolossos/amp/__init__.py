"""Mixed-precision pieces shared by every plugin and engine: the loss-scale policy and scalers,
overflow detection, and the cast helper.

- :class:`LossScalePolicy`: the seven loss-scale settings, validated, in one object.
- :class:`DynamicGradScaler` / :class:`ConstantGradScaler`: decide the loss scale.
- :func:`unscale_and_check_`, :func:`has_inf_or_nan`: unscale gradients and detect inf/NaN locally.
- :func:`all_reduce_overflow`: make every rank take the same skip-or-step decision.
- :func:`cast_floating`: cast the floating tensors of nested inputs/outputs to a dtype.

Example:
    >>> import torch
    >>> from kolossos.amp import DynamicGradScaler, all_reduce_overflow, unscale_and_check_
    >>> scaler = DynamicGradScaler(initial_scale=2**8)
    >>> grads = [torch.full((2,), 2.0**8)]  # as left by (loss * scaler.scale).backward()
    >>> overflow = all_reduce_overflow(unscale_and_check_(grads, scaler.inv_scale))
    >>> scaler.update(overflow).value, grads[0].tolist()
    ('good', [1.0, 1.0])
"""

from kolossos.amp.cast import cast_floating
from kolossos.amp.grad_scaler import (
    BaseGradScaler,
    ConstantGradScaler,
    DynamicGradScaler,
    ScaleEvent,
)
from kolossos.amp.loss_scale import LOSS_SCALE_KEYWORDS, LossScalePolicy
from kolossos.amp.overflow import all_reduce_overflow, has_inf_or_nan, unscale_and_check_

__all__ = [
    "LOSS_SCALE_KEYWORDS",
    "BaseGradScaler",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "LossScalePolicy",
    "ScaleEvent",
    "all_reduce_overflow",
    "cast_floating",
    "has_inf_or_nan",
    "unscale_and_check_",
]
