"""``LowLevelZeroModel``: the model side of ZeRO-1/2 — on the device, in the working dtype."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.accelerator import get_accelerator
from kolossos.amp import cast_floating
from kolossos.interface import ModelWrapper
from kolossos.lazy import materialize_on

__all__ = ["LowLevelZeroModel"]


class LowLevelZeroModel(ModelWrapper):
    """Moves ``module`` to the accelerator's device and casts its floating-point parameters and
    buffers to ``dtype`` (fp16/bf16 training keeps low-precision working weights; the fp32 master
    copies belong to the optimizer). Floating-point inputs are cast to ``dtype`` in ``forward``;
    outputs are returned as the module computes them.

    Args:
        module: the user's model.
        dtype: the working dtype (``torch.float32`` keeps the model as it is).

    Example:
        >>> model = LowLevelZeroModel(torch.nn.Linear(4, 2), torch.bfloat16)
        >>> model(torch.ones(1, 4)).dtype
        torch.bfloat16
    """

    def __init__(
        self, module: nn.Module, dtype: torch.dtype, group: dist.ProcessGroup | None = None
    ) -> None:
        device = get_accelerator().get_current_device()
        materialize_on(module, device, group)  # COLLECTIVE when the model was built lazily
        module = module.to(device)
        if dtype != torch.float32:
            module = module.to(dtype)
        super().__init__(module)
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.dtype != torch.float32:
            args, kwargs = cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
        return self.module(*args, **kwargs)
