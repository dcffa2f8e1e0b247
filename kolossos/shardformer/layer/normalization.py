"""Colossal-AI's normalisation converters: ``FusedLayerNorm`` / ``FusedRMSNorm`` (apex kernels in
Colossal-AI) and ``LayerNorm`` / ``RMSNorm`` (which only mark parameters for sequence
parallelism).

kolossos has no apex: the fused converters fall back to PyTorch's own norms with the numbers of
the module they convert. ``nn.LayerNorm`` is kept as it is (``torch.nn.functional.layer_norm`` is
already one fused kernel); a Hugging Face RMSNorm (``LlamaRMSNorm`` and the like: a 1-D
``weight`` and ``variance_epsilon``) becomes :class:`TorchRMSNorm`, which calls
``torch.nn.functional.rms_norm`` in float32 and shares the original weight; ``nn.RMSNorm`` is kept.

None of these classes is instantiated: use ``from_native_module``.

Example:
    >>> norm = FusedLayerNorm.from_native_module(ln_1, sp_partial_derived=True)  # doctest: +SKIP
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d import mark_sequence_parallel

__all__ = [
    "BaseLayerNorm",
    "FusedLayerNorm",
    "FusedRMSNorm",
    "LayerNorm",
    "RMSNorm",
    "TorchRMSNorm",
]


def _no_instances(name: str) -> NoReturn:
    raise NotImplementedError(
        f"{name} is not built directly; convert an existing module with "
        f"{name}.from_native_module(module)."
    )


def _check_extra(owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Accept only ``process_group`` (the sharder passes it to every converter; a norm is
    replicated, so it needs none).

    Raises:
        TypeError: any other argument.
    """
    extra = {key: value for key, value in kwargs.items() if key != "process_group"}
    if args or extra:
        raise TypeError(
            f"{owner}.from_native_module takes the module, sp_partial_derived and "
            f"process_group; got unexpected arguments {args!r} {extra!r}."
        )


def _mark(module: nn.Module, sp_partial_derived: bool) -> None:
    """Mark the norm's parameters as sequence-parallel: under sequence parallelism each rank's
    gradient covers its part of the sequence and must be summed over the group
    (``all_reduce_sequence_parallel_grads``)."""
    if not isinstance(sp_partial_derived, bool):
        raise TypeError(f"sp_partial_derived={sp_partial_derived!r} must be a bool.")
    if sp_partial_derived:
        for param in module.parameters(recurse=False):
            mark_sequence_parallel(param)


def _layer_norm(owner: str, module: nn.Module) -> nn.LayerNorm:
    if not isinstance(module, nn.LayerNorm):
        raise TypeError(
            f"{owner}.from_native_module converts an nn.LayerNorm, got {type(module).__name__}; "
            "use RMSNorm / FusedRMSNorm for RMS norms."
        )
    return module


class TorchRMSNorm(nn.Module):
    """RMS norm with Hugging Face's numerics (normalise in float32, cast back, scale by
    ``weight``) on ``torch.nn.functional.rms_norm``.

    Args:
        weight: the scale, shared with the module it replaces.
        eps: the variance epsilon.
    """

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class BaseLayerNorm(ABC):
    """Base of the normalisation converters (Colossal-AI's ``BaseLayerNorm``)."""

    @staticmethod
    @abstractmethod
    def from_native_module(
        module: nn.Module, sp_partial_derived: bool = False, *args: Any, **kwargs: Any
    ) -> nn.Module:
        """Convert ``module``; ``sp_partial_derived`` marks its parameters for the
        sequence-parallel gradient sum."""


class LayerNorm(BaseLayerNorm):
    """Keeps an ``nn.LayerNorm`` and optionally marks it for sequence parallelism."""

    def __init__(self) -> None:
        _no_instances("LayerNorm")

    @staticmethod
    def from_native_module(
        module: nn.Module, sp_partial_derived: bool = False, *args: Any, **kwargs: Any
    ) -> nn.Module:
        """Return ``module`` (an ``nn.LayerNorm``), its parameters marked when
        ``sp_partial_derived``.

        Raises:
            TypeError: ``module`` is not an ``nn.LayerNorm``, or an unknown argument.
        """
        _check_extra("LayerNorm", args, kwargs)
        norm = _layer_norm("LayerNorm", module)
        _mark(norm, sp_partial_derived)
        return norm


class RMSNorm(BaseLayerNorm):
    """Keeps an RMS norm module and optionally marks its weight for sequence parallelism."""

    def __init__(self) -> None:
        _no_instances("RMSNorm")

    @staticmethod
    def from_native_module(
        module: nn.Module, sp_partial_derived: bool = False, *args: Any, **kwargs: Any
    ) -> nn.Module:
        """Return ``module``, its weight marked when ``sp_partial_derived``.

        Raises:
            TypeError: an unknown argument.
        """
        _check_extra("RMSNorm", args, kwargs)
        _mark(module, sp_partial_derived)
        return module


class FusedLayerNorm(BaseLayerNorm):
    """``nn.LayerNorm`` → PyTorch's layer norm (one fused kernel; apex is not used)."""

    def __init__(self) -> None:
        _no_instances("FusedLayerNorm")

    @staticmethod
    def from_native_module(
        module: nn.Module, sp_partial_derived: bool = False, *args: Any, **kwargs: Any
    ) -> nn.Module:
        """Return ``module`` itself: ``nn.LayerNorm`` already runs PyTorch's fused layer-norm
        kernel, so its numbers (and parameters) are unchanged.

        Raises:
            TypeError: ``module`` is not an ``nn.LayerNorm``, or an unknown argument.
        """
        _check_extra("FusedLayerNorm", args, kwargs)
        norm = _layer_norm("FusedLayerNorm", module)
        _mark(norm, sp_partial_derived)
        return norm


class FusedRMSNorm(BaseLayerNorm):
    """RMS norm → ``torch.nn.functional.rms_norm`` (apex is not used)."""

    def __init__(self) -> None:
        _no_instances("FusedRMSNorm")

    @staticmethod
    def from_native_module(
        module: nn.Module, sp_partial_derived: bool = False, *args: Any, **kwargs: Any
    ) -> nn.Module:
        """Convert a Hugging Face RMSNorm (``weight`` and ``variance_epsilon``, as in
        ``LlamaRMSNorm``) to :class:`TorchRMSNorm` sharing its weight; an ``nn.RMSNorm`` is
        returned as it is.

        Raises:
            TypeError: ``module`` is neither, or an unknown argument.
        """
        _check_extra("FusedRMSNorm", args, kwargs)
        if isinstance(module, nn.RMSNorm):
            _mark(module, sp_partial_derived)
            return module
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
            raise TypeError(
                f"FusedRMSNorm.from_native_module converts nn.RMSNorm or a Hugging Face RMSNorm "
                f"(1-D weight and variance_epsilon, e.g. LlamaRMSNorm); got "
                f"{type(module).__name__}. Keep it with RMSNorm.from_native_module."
            )
        norm = TorchRMSNorm(weight, eps)
        _mark(norm, sp_partial_derived)
        return norm
