"""The fused element-wise kernel of ``enable_jit_fused``: dropout + residual add.

``dropout_add(x, residual, p, training)`` computes ``residual + dropout(x, p)`` (the bias of the
linear before it stays in its GEMM: ``addmm`` already fuses it). On CUDA it runs as one
``torch.compile``'d kernel when the compiler works (checked on first use; any failure falls back
to eager, once, with a warning). Elsewhere (the CPU) it runs eagerly: ``torch.compile`` works on
CPU but costs seconds per shape for a gain that an element-wise add does not repay, and
TorchScript is deprecated.

RNG semantics: the eager path draws the dropout mask with ``torch.nn.functional.dropout`` from the
current generator, exactly as the unfused module (same mask, same ``1/(1-p)`` scaling; under
tensor parallelism the same per-rank / replicated stream). The compiled path keeps the
distribution but inductor draws its own (Philox) numbers unless
``torch._inductor.config.fallback_random`` is set.

Example:
    >>> out = dropout_add(torch.ones(2), torch.zeros(2), 0.0, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["dropout_add", "eager_dropout_add", "fused_kernel_name"]

_Kernel = Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]


def eager_dropout_add(
    x: torch.Tensor, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(x, p)`` with PyTorch's eager ops."""
    return residual + F.dropout(x, p=p, training=training)


_compiled: _Kernel | None = None
_compile_failed = False


def fused_kernel_name(device: torch.device) -> str:
    """``'compile'`` or ``'eager'``: which path :func:`dropout_add` takes on ``device``."""
    if device.type == "cuda" and not _compile_failed and hasattr(torch, "compile"):
        return "compile"
    return "eager"


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``residual + dropout(x, p)``, fused where a compiler works (module doc)."""
    global _compiled, _compile_failed
    if fused_kernel_name(x.device) == "eager":
        return eager_dropout_add(x, residual, p, training)
    try:
        if _compiled is None:
            _compiled = torch.compile(eager_dropout_add, dynamic=True)
        return _compiled(x, residual, p, training)
    except Exception as error:  # any compiler failure: fall back for good
        _compile_failed = True
        warnings.warn(
            f"enable_jit_fused: torch.compile failed on {x.device} ({type(error).__name__}: "
            f"{error}); using the eager dropout + add.",
            stacklevel=2,
        )
        return eager_dropout_add(x, residual, p, training)
