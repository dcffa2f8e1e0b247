"""``FP16Module``: a model whose parameters are fp16, with inputs cast in and outputs cast out."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from kolossos.amp.cast import cast_floating
from kolossos.interface import ModelWrapper


def _bn_input_to_fp32(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(cast_floating(list(args), torch.float32))


def _bn_output_to_fp16(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return cast_floating(output, torch.float16)


class FP16Module(ModelWrapper):
    """Convert ``module`` to fp16; floating inputs are cast to fp16 and floating outputs to
    ``output_dtype`` (fp32 by default, so the loss is computed in full precision).

    Args:
        module: the model (converted in place).
        keep_batchnorm_fp32: keep BatchNorm layers (weights, statistics, computation) in fp32.
        output_dtype: dtype of floating outputs; ``None`` leaves them fp16.
    """

    def __init__(
        self,
        module: nn.Module,
        keep_batchnorm_fp32: bool = False,
        output_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        super().__init__(module)
        self.output_dtype = output_dtype
        module.half()
        if keep_batchnorm_fp32:
            for sub in module.modules():
                if isinstance(sub, _BatchNorm):
                    sub.float()
                    sub.register_forward_pre_hook(_bn_input_to_fp32)
                    sub.register_forward_hook(_bn_output_to_fp16)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(cast_floating(list(args), torch.float16))
        kwargs = cast_floating(kwargs, torch.float16)
        out = self.module(*args, **kwargs)
        return out if self.output_dtype is None else cast_floating(out, self.output_dtype)
