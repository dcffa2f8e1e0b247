"""The base shared by the 1D column- and row-parallel linear layers: building the sharded weight
and bias in the layout of the module they come from (``nn.Linear`` or Hugging Face ``Conv1D``),
initialisers, and :func:`native_linear_weights` (a native module's full weights)."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d._base import (
    GroupArg,
    ParallelModule1D,
    is_conv1d,
    reject_positional,
    to_factory,
    trainable,
)
from kolossos.nn.layer.parallel_1d.initializers import (
    Initializer,
    apply_initializer,
    check_initializers,
)

__all__ = ["LinearOutput", "native_linear_weights"]

LinearOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]
_L = TypeVar("_L", bound="_Linear1D")


def _default_full_weights(
    in_features: int,
    out_features: int,
    bias: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights initialised exactly as ``nn.Linear(in_features, out_features)`` would be (same
    random draws), so a layer built after the same seed equals the dense layer."""
    dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    return dense.weight.detach(), None if dense.bias is None else dense.bias.detach()


def native_linear_weights(
    module: nn.Module,
) -> tuple[int, int, torch.Tensor, torch.Tensor | None, bool]:
    """``(in_features, out_features, weight, bias, conv1d_layout)`` of an ``nn.Linear`` or a
    Hugging Face ``Conv1D``.

    Raises:
        TypeError: ``module`` is neither.
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, module.weight, module.bias, False
    if is_conv1d(module):
        weight = module.weight
        bias = getattr(module, "bias", None)
        assert isinstance(weight, torch.Tensor)
        return weight.shape[0], weight.shape[1], weight, bias, True
    raise TypeError(
        f"expected an nn.Linear or a transformers Conv1D, got {type(module).__name__}; "
        "convert the module first or build the layer with its constructor."
    )


class _Linear1D(ParallelModule1D):
    """Shared construction of the two linear layers."""

    _split_linear_dim: int  # dim of an (out, in) weight that is split

    def _build(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        weight: torch.Tensor | None,
        bias_: torch.Tensor | None,
        conv1d_layout: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        fused_sections: tuple[int, ...] | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
    ) -> None:
        owner = type(self).__name__
        inits = {"weight_initializer": weight_initializer, "bias_initializer": bias_initializer}
        check_initializers(owner, weight is not None, **inits)
        if weight is None and bias_ is not None:
            raise ValueError(
                f"{owner}: bias_ was given without weight; pass both full tensors, or neither "
                "to let the layer initialise them."
            )
        if not bias and bias_ is not None:
            raise ValueError(
                f"{owner}: bias=False but a bias_ tensor was given; pass bias=True to use it."
            )
        self.in_features, self.out_features = in_features, out_features
        self.conv1d_layout = conv1d_layout
        self._fused = fused_sections
        if weight_initializer is not None:
            self._init_weight(weight_initializer, device, dtype)
        else:
            if weight is None:  # the dense layer's draws (its bias unless one is initialised)
                weight, default_bias = _default_full_weights(
                    in_features, out_features, bias, device, dtype
                )
                bias_ = default_bias if bias_initializer is None else None
                weight = weight.t() if conv1d_layout else weight
            else:
                weight, bias_ = to_factory(weight, device, dtype), to_factory(bias_, device, dtype)
            assert weight is not None
            self._set_weight(weight)
        if not bias:
            self.register_parameter("bias", None)
        else:
            self._set_bias(bias_, bias_initializer)

    def _weight_layout(self) -> tuple[tuple[int, int], int]:
        """The full weight's shape and the dimension of it that is split."""
        dim = self._split_linear_dim
        if self.conv1d_layout:
            return (self.in_features, self.out_features), 1 - dim
        return (self.out_features, self.in_features), dim

    def _init_weight(
        self, initializer: Initializer, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> None:
        shape, dim = self._weight_layout()
        self.weight = self._empty_shard(
            shape, dim, device=device, dtype=dtype, fused_sections=self._fused
        )
        fans = {"fan_in": self.in_features, "fan_out": self.out_features}
        apply_initializer(self.weight, initializer, self.process_group, sharded=True, **fans)

    def _set_weight(self, weight: torch.Tensor) -> None:
        shape, dim = self._weight_layout()
        if tuple(weight.shape) != shape:
            raise ValueError(
                f"{type(self).__name__}: weight of shape {tuple(weight.shape)} does not match "
                f"in_features={self.in_features}, out_features={self.out_features} (expected "
                f"{shape})."
            )
        self.weight = self._shard_param(
            weight, dim, fused_sections=self._fused, requires_grad=trainable(weight)
        )

    def _set_bias(self, bias_: torch.Tensor | None, initializer: Initializer | None) -> None:
        dim = 0 if self._split_linear_dim == 0 else None  # column: split; row: replicated
        sections = self._fused if dim is not None else None
        device, dtype = self.weight.device, self.weight.dtype
        if initializer is not None:
            self.bias = self._empty_shard(
                (self.out_features,), dim, device=device, dtype=dtype, fused_sections=sections
            )
            sharded = dim is not None
            apply_initializer(
                self.bias, initializer, self.process_group, sharded=sharded, fan_in=self.in_features
            )
            return
        if bias_ is None:  # nn.Linear's bias initialisation
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            bias_ = torch.empty(self.out_features, device=device, dtype=dtype)
            bias_.uniform_(-bound, bound)
        self.bias = self._shard_param(
            bias_, dim, fused_sections=sections, requires_grad=trainable(bias_)
        )

    @classmethod
    def from_native_module(
        cls: type[_L], module: nn.Module, process_group: GroupArg = None, *args: Any, **kwargs: Any
    ) -> _L:
        """Build from an ``nn.Linear`` or transformers ``Conv1D``, slicing its weights.

        Args:
            module: the layer to shard (left unchanged).
            process_group: the tensor-parallel group (or a one-element list of it; ``None``:
                the world).
            args: not accepted (Colossal-AI's signature lists them); a ``TypeError`` names them.
            kwargs: the constructor's keyword arguments (:class:`Linear1D_Col`:
                ``gather_output``, ``seq_parallel``/``seq_parallel_mode``,
                ``seq_parallel_dim``/``seq_dim``, ``overlap``, ``skip_bias_add``, ``input_comm``,
                ``fused_sections``, ``dtype``, ``device``; :class:`Linear1D_Row`:
                ``parallel_input``, the sequence-parallel options, ``skip_bias_add``,
                ``stream_chunk_num``, ``dtype``, ``device``).
        """
        reject_positional(cls.__name__, args)
        in_f, out_f, weight, bias, conv1d = native_linear_weights(module)
        return cls(
            in_f,
            out_f,
            bias is not None,
            process_group=process_group,
            weight=weight,
            bias_=bias,
            conv1d_layout=conv1d,
            **kwargs,
        )

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight.t() if self.conv1d_layout else self.weight
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_size={self.tp_size}, "
            f"seq_parallel_mode={self.seq_parallel_mode}, conv1d_layout={self.conv1d_layout}"
        )

    seq_parallel_mode: str | None
