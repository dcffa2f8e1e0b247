"""3D linear layers: :class:`Linear3D`, and the classifiers :class:`Classifier3D` (classes
whole) and :class:`VocabParallelClassifier3D` (classes split).

Activations are ``(batch/q**2, ..., features/q)`` blocks (:func:`split_batch_3d` along the batch,
the output group along the features). The weight of :class:`Linear3D` is stored ``(in, out)``
like Colossal-AI's, as ``(in/q, out/q**2)`` blocks; :meth:`full_state` returns ``nn.Linear``'s
``(out, in)`` layout, so a dense ``nn.Linear`` loads it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_1d._comm import reduce_from_tp
from kolossos.nn.layer.parallel_3d._base import Initializer, ParallelModule3D, Splits
from kolossos.nn.layer.parallel_3d._comm import linear_3d, sync_grad
from kolossos.nn.layer.parallel_3d.groups import Groups3D, divide_3d

__all__ = ["Classifier3D", "Linear3D", "VocabParallelClassifier3D", "linear_bias_init"]

LinearOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]


def linear_bias_init(tensor: torch.Tensor, fan_in: int, **_: int) -> None:
    """``nn.Linear``'s bias initialisation, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(tensor, -bound, bound)


class _Linear3DBase(ParallelModule3D):
    """Weights of a linear map ``in -> out`` from a dense ``nn.Linear`` or initializers."""

    weight_splits: Splits
    bias_splits: Splits
    transposed: bool  # the weight is stored (in, out), the dense layer's (out, in)

    def _build(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        weight: torch.Tensor | None,
        bias_: torch.Tensor | None,
        weight_initializer: Initializer | None,
        bias_initializer: Initializer | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        shared: nn.Parameter | None = None,
    ) -> None:
        owner = type(self).__name__
        if (weight is not None or bias_ is not None) and (weight_initializer or bias_initializer):
            raise ValueError(
                f"{owner}: weight/bias_ and weight_initializer/bias_initializer both given; "
                "pass the full tensors or initializers, not both."
            )
        if weight is None and bias_ is not None:
            raise ValueError(f"{owner}: bias_ without weight; pass both full tensors.")
        if bias_ is not None and not bias:
            raise ValueError(f"{owner}: bias=False but a bias_ tensor was given.")
        self.in_features, self.out_features = in_features, out_features
        fans = {"fan_in": in_features, "fan_out": out_features}
        stored = (in_features, out_features) if self.transposed else (out_features, in_features)
        if shared is not None:  # tied to another layer's block, which keeps its spec
            self.weight = shared
        elif weight_initializer is None:
            if weight is None:  # the dense layer's draws: same seed, same full matrix
                dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
                weight, bias_ = dense.weight, dense.bias if bias_initializer is None else None
            self._check_dense(weight, (out_features, in_features), "weight")
            full = weight.detach().to(device=device, dtype=dtype)
            self.weight = self._shard(
                self._from_dense("weight", full), self.weight_splits, transposed=self.transposed
            )
        else:
            full = self._initial_full(stored, weight_initializer, device, dtype, **fans)
            self.weight = self._shard(full, self.weight_splits, transposed=self.transposed)
        if not bias:
            self.register_parameter("bias", None)
        elif bias_ is not None:
            self._check_dense(bias_, (out_features,), "bias")
            self.bias = self._shard(bias_.detach().to(self.weight), self.bias_splits)
        else:
            init = bias_initializer or linear_bias_init
            self.bias = self._initialized(
                (out_features,),
                self.bias_splits,
                init,
                device,
                self.weight.dtype,
                fan_in=in_features,
            )

    def _check_dense(self, tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{type(self).__name__}: {name} of shape {tuple(tensor.shape)} does not match "
                f"in_features={self.in_features}, out_features={self.out_features} (expected "
                f"{shape}, nn.Linear's layout)."
            )

    def _to_dense(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full.t().contiguous() if name == "weight" and self.transposed else full

    def _from_dense(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        return dense.t().contiguous() if name == "weight" and self.transposed else dense

    @classmethod
    def from_native_module(cls, module: nn.Module, groups: Groups3D, **kwargs: Any) -> Any:
        """Build from an ``nn.Linear``, slicing its weights (the module is left unchanged)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(module).__name__}.")
        return cls(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            groups=groups,
            weight=module.weight,
            bias_=module.bias,
            **kwargs,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, depth={self.depth}"
        )


class Linear3D(_Linear3DBase):
    """Linear layer of 3D tensor parallelism (F0:6706-6904).

    Rank ``(w, i, o)`` holds the weight block ``(in/q, out/q**2)`` at rows block ``o`` and columns
    block ``i * q + w`` of the ``(in, out)`` matrix, and the bias block ``i`` of ``q`` (repeated
    on the output x weight plane, whose gradient it sums). The input is a
    ``(batch/q**2, ..., in/q)`` block (:func:`split_batch_3d`, features by the output group);
    the output, ``(batch/q**2, ..., out/q)``, is laid out for :attr:`output_groups`.

    Args:
        in_features: input size (divisible by ``q``).
        out_features: output size (divisible by ``q**2``).
        bias: whether the layer has a bias.
        dtype: parameter dtype.
        skip_bias_add: return ``(output, bias)`` without adding the bias.
        weight_initializer: ``init(block, fan_in=in, fan_out=out)``; default: ``nn.Linear``'s
            initialisation of the full matrix (same seed on every rank: the dense layer's
            matrix, sliced).
        bias_initializer: ``init(block, fan_in=in)``.
        groups: the groups of the input's layout (keyword-only).
        weight: the full ``(out, in)`` weight (``nn.Linear``'s layout) to slice.
        bias_: the full bias to slice.
        device: where the parameters live.

    Raises:
        ValueError: a size not divisible as required.

    Example:
        >>> fc1 = Linear3D(256, 1024, groups=build_groups_3d())  # 8 ranks  # doctest: +SKIP
        >>> fc1.weight.shape  # doctest: +SKIP
        torch.Size([128, 256])
        >>> fc2 = Linear3D(1024, 256, groups=fc1.output_groups)  # doctest: +SKIP
    """

    weight_splits = ((0, "output"), (1, "input"), (1, "weight"))
    bias_splits = ((0, "input"),)
    transposed = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        skip_bias_add: bool = False,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        groups: Groups3D,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        q = self._init_groups(groups, swaps=True).depth
        divide_3d(in_features, q, "in_features")
        divide_3d(out_features, q**2, "out_features")
        self.skip_bias_add = skip_bias_add
        self._build(
            in_features,
            out_features,
            bias,
            weight,
            bias_,
            weight_initializer,
            bias_initializer,
            device,
            dtype,
        )

    def forward(self, x: torch.Tensor) -> LinearOutput:
        y = linear_3d(x, self.weight, self.groups)
        bias = None if self.bias is None else sync_grad(self.bias, self.groups.output_x_weight)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias


class Classifier3D(_Linear3DBase):
    """Classifier with the classes whole: logits ``(batch/q**2, ..., classes)``, the same on
    the ranks of the output group.

    The weight ``(classes, in)`` (``nn.Linear``'s layout) is split along ``in`` by the output
    group and repeated on the input x weight plane; the bias is repeated on every rank.

    Args:
        in_features: input size (divisible by ``q``).
        num_classes: number of classes.
        weight: a parameter to share (a tied ``(classes, in/q)`` embedding block, e.g. an
            :class:`Embedding3D`'s), or the full ``(classes, in)`` tensor to slice.
        bias: whether the layer has a bias.
        dtype: parameter dtype.
        weight_initializer: ``init(block, fan_in=in, fan_out=classes)``; default: ``nn.Linear``.
        bias_initializer: ``init(bias, fan_in=in)``.
        groups: the groups of the input's layout (keyword-only).
        bias_: the full bias.
        device: where the parameters live.

    Example:
        >>> head = Classifier3D(64, 10, groups=groups)  # doctest: +SKIP
        >>> logits = head(x)  # (batch/q**2, 10)  # doctest: +SKIP
    """

    weight_splits = ((1, "output"),)
    bias_splits = ()
    transposed = False

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: torch.Tensor | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        groups: Groups3D,
        bias_: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        q = self._init_groups(groups).depth
        divide_3d(in_features, q, "in_features")
        self.num_classes = num_classes
        shared = _shared_weight(weight, (num_classes, in_features // q))
        self._build(
            in_features,
            num_classes,
            bias,
            weight if shared is None else None,
            bias_,
            weight_initializer,
            bias_initializer,
            device,
            dtype,
            shared,
        )
        self.has_weight = shared is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sync_grad(self.weight, self.groups.input_x_weight)
        partial = F.linear(x, weight)  # a partial sum over the input features
        logits = reduce_from_tp(partial, self.groups.output)  # SYNC POINT
        if self.bias is None:
            return logits
        return logits + sync_grad(self.bias, self.groups.input_x_weight)


class VocabParallelClassifier3D(_Linear3DBase):
    """Classifier with the classes split like :class:`Linear3D`'s outputs: logits
    ``(batch/q**2, ..., classes/q)`` laid out for :attr:`output_groups` (feed them to
    :class:`VocabParallelCrossEntropyLoss3D` with those groups).

    The weight is stored ``(classes, in)`` (``nn.Linear``'s layout) as ``(classes/q**2, in/q)``
    blocks: classes block ``i * q + w``, input block ``o``.

    Args: as :class:`Classifier3D` (``num_classes`` divisible by ``q**2``; a shared ``weight``
    is a ``(classes/q**2, in/q)`` block, e.g. a :class:`VocabParallelEmbedding3D`'s).

    Example:
        >>> head = VocabParallelClassifier3D(64, 32, groups=groups)  # doctest: +SKIP
        >>> loss = VocabParallelCrossEntropyLoss3D(groups=head.output_groups)  # doctest: +SKIP
    """

    weight_splits = ((0, "input"), (0, "weight"), (1, "output"))
    bias_splits = ((0, "input"),)
    transposed = False

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: torch.Tensor | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        groups: Groups3D,
        bias_: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        q = self._init_groups(groups, swaps=True).depth
        divide_3d(in_features, q, "in_features")
        divide_3d(num_classes, q**2, "num_classes")
        self.num_classes = num_classes
        shared = _shared_weight(weight, (num_classes // q**2, in_features // q))
        self._build(
            in_features,
            num_classes,
            bias,
            weight if shared is None else None,
            bias_,
            weight_initializer,
            bias_initializer,
            device,
            dtype,
            shared,
        )
        self.has_weight = shared is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear_3d(x, self.weight.t(), self.groups)
        if self.bias is None:
            return logits
        return logits + sync_grad(self.bias, self.groups.output_x_weight)


def _shared_weight(weight: torch.Tensor | None, block: tuple[int, ...]) -> nn.Parameter | None:
    """``weight`` when it is a parameter of the local block shape (to share), else ``None``."""
    if isinstance(weight, nn.Parameter) and tuple(weight.shape) == block:
        return weight
    return None
