"""2D linear layers: :class:`Linear2D` (SUMMA ``Y = X W``), :class:`Classifier2D` (whole-class
logits) and :class:`VocabParallelClassifier2D` (class-split logits, SUMMA ``Y = X Wᵀ``).

Layouts on rank ``(i, j)`` of the ``q x q`` grid (``B`` rows of the input, ``K`` input and ``N``
output features; :mod:`~kolossos.nn.layer.parallel_2d.sharding` has the specs):

* :class:`Linear2D`: input ``[B/q, K/q]`` block ``(i, j)``; weight ``[K/q, N/q]`` block
  ``(i, j)`` of ``Wᵀ`` (Colossal-AI's layout: the docs print these shapes); bias ``[N/q²]``,
  piece ``i`` of output block ``j``; output ``[B/q, N/q]`` block ``(i, j)``.
* :class:`Classifier2D`: weight ``[N, K/q²]`` (piece ``i`` of input block ``j``), bias ``[N]``
  replicated; output ``[B/q, N]`` (batch block ``i``, the same on every column).
* :class:`VocabParallelClassifier2D`: weight ``[N/q, K/q]`` block ``(i, j)`` of ``W``
  (``nn.Linear`` layout, tieable with :class:`VocabParallelEmbedding2D`); output ``[B/q, N/q]``.

Default initialisation: the dense layer's (``nn.Linear(K, N)`` drawn on every rank from the same
generator state, then each rank keeps its block).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kolossos.nn.layer.parallel_1d._comm import copy_to_tp, reduce_from_tp
from kolossos.nn.layer.parallel_2d._base import Initializer, ParallelModule2D, init_full
from kolossos.nn.layer.parallel_2d._comm import gather_weight_2d
from kolossos.nn.layer.parallel_2d.grid import Groups2D, check_divisible
from kolossos.nn.layer.parallel_2d.sharding import get_2d_spec
from kolossos.nn.layer.parallel_2d.summa import summa_ab, summa_abt

__all__ = ["Classifier2D", "Linear2D", "VocabParallelClassifier2D"]

_BIAS_SPLITS: tuple[tuple[int, str], ...] = ((0, "row"), (0, "col"))
"""Output block ``j``, then piece ``i`` of it (shared by every vector of output features)."""

LinearOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _dense_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    weight_initializer: Initializer | None,
    bias_initializer: Initializer | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full ``(weight [out, in], bias)`` of ``nn.Linear(in, out)`` after the same seed, with
    the user initializers applied to the full tensors where given."""
    dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
    weight = init_full(
        dense.weight.detach(), weight_initializer, fan_in=in_features, fan_out=out_features
    )
    full_bias = None
    if dense.bias is not None:
        full_bias = init_full(dense.bias.detach(), bias_initializer, fan_in=in_features)
    return weight, full_bias


class Linear2D(ParallelModule2D):
    """Linear layer of 2D (SUMMA) tensor parallelism: ``Y = X W + b`` with ``X``, ``W`` and
    ``Y`` block-distributed over the ``q x q`` grid (see the module docstring).

    The positional order is Colossal-AI's; ``groups`` and ``device`` are keyword-only.

    Args:
        in_features: full input size ``K`` (divisible by ``q``).
        out_features: full output size ``N`` (divisible by ``q``, by ``q²`` with a bias).
        bias: whether the layer has a bias.
        dtype: parameter dtype.
        skip_bias_add: return ``(output, bias block [N/q])`` without adding the bias.
        weight_initializer: ``init(full_weight, fan_in=K, fan_out=N)`` applied to the full
            ``[N, K]`` weight before slicing; ``None``: ``nn.Linear``'s initialisation.
        bias_initializer: ``init(full_bias, fan_in=K)``; ``None``: ``nn.Linear``'s.
        groups: the grid.
        device: where the parameters live.

    Raises:
        ValueError: a feature size not divisible as above.
        TypeError: ``groups`` is not a :class:`Groups2D`.

    Example:
        >>> fc = Linear2D(256, 1024, groups=groups)  # on 4 ranks  # doctest: +SKIP
        >>> fc.weight.shape  # doctest: +SKIP
        torch.Size([128, 512])
        >>> fc(x_ij).shape  # x_ij: [8, 128]  # doctest: +SKIP
        torch.Size([8, 512])
    """

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
        groups: Groups2D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._init_groups(groups)
        name, q = type(self).__name__, self.groups.q
        self.input_size_per_partition = check_divisible(name, "in_features", in_features, q)
        self.hidden_size_per_partition = check_divisible(name, "out_features", out_features, q)
        if bias:
            check_divisible(name, "out_features (with a bias)", out_features, q * q)
        self.in_features, self.out_features = in_features, out_features
        self.skip_bias_add = skip_bias_add
        weight, full_bias = _dense_linear(
            in_features, out_features, bias, device, dtype, weight_initializer, bias_initializer
        )
        self.weight = self._block(weight, ((0, "col"), (1, "row")), transposed=True)
        self.bias = None if full_bias is None else self._block(full_bias, _BIAS_SPLITS)

    @classmethod
    def from_native_module(cls, module: nn.Linear, groups: Groups2D, **kwargs: Any) -> Linear2D:
        """Build from an ``nn.Linear`` (left unchanged), each rank keeping its blocks.

        Args:
            module: the dense layer.
            groups: the grid.
            kwargs: ``skip_bias_add``, ``device``, ``dtype``.
        """
        if not isinstance(module, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(module).__name__}.")
        layer = cls(
            module.in_features,
            module.out_features,
            module.bias is not None,
            groups=groups,
            **kwargs,
        )
        layer.load_full_state(module.state_dict())
        return layer

    def forward(self, x: torch.Tensor) -> LinearOutput:
        """``x``: block ``[..., K/q]`` (batch block ``i``, feature block ``j``). COLLECTIVE."""
        y = summa_ab(x, self.weight, self.groups)
        if self.bias is None:
            return y
        bias = gather_weight_2d(self.bias, self.groups)  # this column's [N/q] block
        return (y, bias) if self.skip_bias_add else y + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, q={self.groups.q}"
        )


class Classifier2D(ParallelModule2D):
    """Classifier head of 2D parallelism: whole-class logits ``[B/q, N]`` (batch block ``i``,
    the same on every rank of a grid row), for :class:`CrossEntropyLoss2D` and
    :class:`Accuracy2D`.

    Args:
        in_features: full input size ``K`` (divisible by ``q²``).
        num_classes: number of classes ``N``.
        weight: a parameter to share (tied), of this rank's shape ``[N, K/q²]`` and layout
            (e.g. :class:`Embedding2D`'s weight); ``None`` creates one.
        bias: whether the layer has a (replicated) bias.
        dtype: parameter dtype.
        weight_initializer: ``init(full_weight, fan_in=K, fan_out=N)``; ``None``: ``nn.Linear``'s.
        bias_initializer: ``init(full_bias, fan_in=K)``; ``None``: ``nn.Linear``'s.
        groups: the grid.
        device: where the parameters live.

    Example:
        >>> head = Classifier2D(64, 10, groups=groups)  # doctest: +SKIP
        >>> head(x_ij).shape  # x_ij: [B/q, 64/q]  # doctest: +SKIP
        torch.Size([4, 10])
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        groups: Groups2D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._init_groups(groups)
        name, q = type(self).__name__, self.groups.q
        self.input_size_per_partition = check_divisible(name, "in_features", in_features, q * q)
        self.in_features, self.num_classes = in_features, num_classes
        full_w, full_b = _dense_linear(
            in_features, num_classes, bias, device, dtype, weight_initializer, bias_initializer
        )
        self.has_weight = weight is None
        if weight is None:
            self.weight = self._block(full_w, ((1, "row"), (1, "col")))
        else:
            expected = (num_classes, self.input_size_per_partition)
            if tuple(weight.shape) != expected:
                raise ValueError(
                    f"{name}: the shared weight has shape {tuple(weight.shape)}, expected this "
                    f"rank's block {expected}; share an Embedding2D weight of the same sizes."
                )
            self.weight = weight
        self.bias = None if full_b is None else nn.Parameter(full_b.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: block ``[..., K/q]``; returns ``[..., N]`` (batch block ``i``). COLLECTIVE."""
        weight = gather_weight_2d(self.weight, self.groups, dim=-1)  # [N, K/q], input block j
        partial = x @ weight.t()
        logits = reduce_from_tp(partial, self.groups.row)  # sum over the input blocks
        if self.bias is not None:
            # replicated bias: each row's gradient covers its batch block; sum over the rows
            logits = logits + copy_to_tp(self.bias, self.groups.col)
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, q={self.groups.q}"


class VocabParallelClassifier2D(ParallelModule2D):
    """Classifier with the classes split over the grid columns: logits ``[B/q, N/q]`` block
    ``(i, j)``, for :class:`VocabParallelCrossEntropyLoss2D`.

    Args:
        in_features: full input size ``K`` (divisible by ``q``).
        num_classes: number of classes ``N`` (divisible by ``q``; by ``q²`` with a bias).
        weight: a parameter to share (tied), this rank's ``[N/q, K/q]`` block of ``W`` (e.g.
            :class:`VocabParallelEmbedding2D`'s weight); ``None`` creates one.
        bias: whether the layer has a bias.
        dtype: parameter dtype.
        weight_initializer: ``init(full_weight, fan_in=K, fan_out=N)``; ``None``: ``nn.Linear``'s.
        bias_initializer: ``init(full_bias, fan_in=K)``; ``None``: ``nn.Linear``'s.
        groups: the grid.
        device: where the parameters live.

    Example:
        >>> head = VocabParallelClassifier2D(64, 32, groups=groups)  # doctest: +SKIP
        >>> head(x_ij).shape  # [B/q, 64/q] -> [B/q, 32/q]  # doctest: +SKIP
        torch.Size([4, 16])
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        groups: Groups2D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._init_groups(groups)
        name, q = type(self).__name__, self.groups.q
        self.input_size_per_partition = check_divisible(name, "in_features", in_features, q)
        self.output_size_per_partition = check_divisible(name, "num_classes", num_classes, q)
        if bias:
            check_divisible(name, "num_classes (with a bias)", num_classes, q * q)
        self.in_features, self.num_classes = in_features, num_classes
        full_w, full_b = _dense_linear(
            in_features, num_classes, bias, device, dtype, weight_initializer, bias_initializer
        )
        self.has_weight = weight is None
        if weight is None:
            self.weight = self._block(full_w, ((0, "col"), (1, "row")))
        else:
            expected = (self.output_size_per_partition, self.input_size_per_partition)
            if tuple(weight.shape) != expected or get_2d_spec(weight) is None:
                raise ValueError(
                    f"{name}: the shared weight must be a 2D block of shape {expected} (e.g. a "
                    f"VocabParallelEmbedding2D weight), got {tuple(weight.shape)}."
                )
            self.weight = weight
        self.bias = None if full_b is None else self._block(full_b, _BIAS_SPLITS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: block ``[..., K/q]``; returns block ``[..., N/q]``. COLLECTIVE."""
        y = summa_abt(x, self.weight, self.groups)
        if self.bias is not None:
            y = y + gather_weight_2d(self.bias, self.groups)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, q={self.groups.q}"
