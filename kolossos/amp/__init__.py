"""Mixed-precision pieces shared by every plugin and engine: the loss-scale policy and scalers,
overflow detection, and the cast helper.

- :class:`LossScalePolicy`: the seven loss-scale settings, validated, in one object.
- :class:`DynamicGradScaler` / :class:`ConstantGradScaler`: decide the loss scale.
- :func:`unscale_and_check_`, :func:`has_inf_or_nan`: unscale gradients and detect inf/NaN locally.
- :func:`all_reduce_overflow`: make every rank take the same skip-or-step decision.
- :func:`cast_floating`: cast the floating tensors of nested inputs/outputs to a dtype.
- ``AMP_TYPE``, ``convert_to_amp`` (and ``convert_to_torch_amp``/``naive``/``apex``): the legacy
  API of :mod:`kolossos.legacy.amp`, resolved lazily (importing this package never loads it).

Example:
    >>> import torch
    >>> from kolossos.amp import DynamicGradScaler, all_reduce_overflow, unscale_and_check_
    >>> scaler = DynamicGradScaler(initial_scale=2**8)
    >>> grads = [torch.full((2,), 2.0**8)]  # as left by (loss * scaler.scale).backward()
    >>> overflow = all_reduce_overflow(unscale_and_check_(grads, scaler.inv_scale))
    >>> scaler.update(overflow).value, grads[0].tolist()
    ('good', [1.0, 1.0])
"""

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes
from kolossos.amp.cast import cast_floating
from kolossos.amp.grad_scaler import (
    BaseGradScaler,
    ConstantGradScaler,
    DynamicGradScaler,
    ScaleEvent,
)
from kolossos.amp.loss_scale import LOSS_SCALE_KEYWORDS, LossScalePolicy
from kolossos.amp.overflow import all_reduce_overflow, has_inf_or_nan, unscale_and_check_

if TYPE_CHECKING:
    from kolossos.legacy.amp import (
        AMP_TYPE,
        convert_to_amp,
        convert_to_apex_amp,
        convert_to_naive_amp,
        convert_to_torch_amp,
    )

_LEGACY = ("AMP_TYPE", "convert_to_amp", "convert_to_apex_amp", "convert_to_naive_amp")
_LAZY = {name: ("kolossos.legacy.amp", name) for name in (*_LEGACY, "convert_to_torch_amp")}

__all__ = [
    "AMP_TYPE",
    "LOSS_SCALE_KEYWORDS",
    "BaseGradScaler",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "LossScalePolicy",
    "ScaleEvent",
    "all_reduce_overflow",
    "cast_floating",
    "convert_to_amp",
    "convert_to_apex_amp",
    "convert_to_naive_amp",
    "convert_to_torch_amp",
    "has_inf_or_nan",
    "unscale_and_check_",
]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
