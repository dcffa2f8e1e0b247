"""2.5D linear layers: :class:`Linear2p5D` (Tesseract SUMMA), :class:`Classifier2p5D` (class
logits of the whole batch block) and :class:`VocabParallelClassifier2p5D` (logits split over the
classes).

All take an activation block ``(..., K/q)`` (batch block ``k * q + i``, feature block ``j``)
and build their parameters from the dense layer's initialisation (same seed, same full matrix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kolossos.nn.layer.parallel_2p5d._comm import gather_param, reduce_over, replicated_param
from kolossos.nn.layer.parallel_2p5d._init import Initializer, check_initializer, full_init
from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D, divide
from kolossos.nn.layer.parallel_2p5d.matmul import tesseract_matmul, tesseract_matmul_nt
from kolossos.nn.layer.parallel_2p5d.sharding import ParallelModule2p5D, get_2p5d_spec

__all__ = ["Classifier2p5D", "Linear2p5D", "VocabParallelClassifier2p5D"]

Device = torch.device | str | None


def _dense_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    device: Device,
    dtype: torch.dtype | None,
    inits: tuple[Initializer | None, Initializer | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full ``(out, in)`` weight and bias of ``nn.Linear(in, out)`` (its random draws),
    refilled by the initializers where given."""
    dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    fans = {"fan_in": in_features}
    weight = full_init(dense.weight.detach(), inits[0], fan_out=out_features, **fans)
    if dense.bias is None:
        return weight, None
    return weight, full_init(dense.bias.detach(), inits[1], **fans)


def _check_input(owner: str, x: torch.Tensor, width: int) -> None:
    if x.shape[-1] != width:
        raise ValueError(
            f"{owner}: the input's last dimension is {x.shape[-1]}, expected this rank's feature "
            f"block of {width}; split the input with split_tensor_2p5d."
        )


class Linear2p5D(ParallelModule2p5D):
    """``y = x A^T + b`` over a ``q x q x d`` tesseract (Colossal-AI's ``Linear2p5D``).

    The weight block ``(i, j)`` is kept as Colossal-AI does, ``(in/q, out/q)`` (the transpose of
    the dense ``(out, in)`` weight's piece); the bias is split by the column index. Input and
    output are activation blocks: ``(..., in/q)`` to ``(..., out/q)``.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: whether to learn an additive bias.
        dtype: parameter dtype.
        skip_bias_add: return ``(output, bias)`` without adding the bias (for fusion).
        weight_initializer: ``init(tensor, fan_in=, fan_out=)`` applied to the full weight
            (default: ``nn.Linear``'s).
        bias_initializer: ``init(tensor, fan_in=)`` applied to the full bias.
        groups: the tesseract's groups.
        device: parameter device.

    Raises:
        ValueError: ``in_features`` or ``out_features`` is not divisible by ``q``.

    Example:
        >>> layer = Linear2p5D(256, 1024, groups=groups)  # q = 2, d = 2  # doctest: +SKIP
        >>> layer.weight.shape  # doctest: +SKIP
        torch.Size([128, 512])
        >>> y = layer(split_tensor_2p5d(x, groups))  # (4, 512) for x of (16, 256)  # doctest: +SKIP
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
        groups: Groups2p5D,
        device: Device = None,
    ) -> None:
        super().__init__()
        owner, q = type(self).__name__, groups.tesseract_dim
        self.input_size_per_partition = divide(in_features, q, "in_features", owner)
        self.hidden_size_per_partition = divide(out_features, q, "out_features", owner)
        check_initializer(owner, "weight_initializer", weight_initializer)
        check_initializer(owner, "bias_initializer", bias_initializer)
        self.groups = groups
        self.in_features, self.out_features = in_features, out_features
        self.skip_bias_add = skip_bias_add
        inits = (weight_initializer, bias_initializer)
        weight, bias_ = _dense_linear(in_features, out_features, bias, device, dtype, inits)
        self.weight = self._shard(weight, row_dim=1, col_dim=0, transposed=True)
        if bias_ is None:
            self.register_parameter("bias", None)
        else:
            self.bias = self._shard(bias_, row_dim=None, col_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """COLLECTIVE over the tesseract (see :func:`tesseract_matmul`)."""
        _check_input(type(self).__name__, x, self.input_size_per_partition)
        out = tesseract_matmul(x, self.weight, self.groups)
        bias = None if self.bias is None else replicated_param(self.bias, self.groups.xz)
        if self.skip_bias_add:
            return out, bias
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, q={self.groups.tesseract_dim}, "
            f"depth={self.groups.tesseract_dep}"
        )


def _tie(
    owner: str, weight: torch.Tensor, full_shape: tuple[int, int], dims: tuple[int, int]
) -> None:
    """Check that a weight to share has the layout this classifier needs."""
    spec = get_2p5d_spec(weight)
    if (
        not isinstance(weight, nn.Parameter)
        or spec is None
        or spec.full_shape != full_shape
        or (spec.row_dim, spec.col_dim) != dims
        or spec.transposed
    ):
        raise ValueError(
            f"{owner}: weight= must be the 2.5D weight of full shape {full_shape} to share "
            f"(split by (row, col) dims {dims}), e.g. the matching 2.5D embedding's weight."
        )


class Classifier2p5D(ParallelModule2p5D):
    """Class logits of each batch block (Colossal-AI's ``Classifier2p5D``): the weight
    ``(num_classes, in)`` is split along ``in`` into ``q * q`` pieces (piece ``j * q + i``, as
    :class:`~kolossos.nn.layer.parallel_2p5d.embedding.Embedding2p5D`, so the two can share
    it); the bias is whole. Input ``(..., in/q)``; output ``(..., num_classes)``, identical on
    the ranks of a grid row.

    Args:
        in_features: size of each input sample.
        num_classes: number of classes.
        weight: an ``Embedding2p5D`` weight to share (tied); this layer then owns only its bias.
        bias: whether to learn an additive bias.
        dtype: parameter dtype.
        weight_initializer: applied to the full weight (default: ``nn.Linear``'s).
        bias_initializer: applied to the full bias.
        groups: the tesseract's groups.
        device: parameter device.

    Example:
        >>> head = Classifier2p5D(64, 10, groups=groups)  # doctest: +SKIP
        >>> logits = head(x_blk)  # (B/(d*q), 10)  # doctest: +SKIP
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
        groups: Groups2p5D,
        device: Device = None,
    ) -> None:
        super().__init__()
        owner, q = type(self).__name__, groups.tesseract_dim
        self.input_size_per_partition = divide(in_features, q * q, "in_features", owner) * q
        check_initializer(owner, "weight_initializer", weight_initializer)
        check_initializer(owner, "bias_initializer", bias_initializer)
        self.groups = groups
        self.in_features, self.num_classes = in_features, num_classes
        inits = (weight_initializer, bias_initializer)
        full_w, full_b = _dense_linear(in_features, num_classes, bias, device, dtype, inits)
        if weight is not None:
            _tie(owner, weight, (num_classes, in_features), (1, 1))
            self.weight = weight
            self._tied: tuple[str, ...] = ("weight",)
        else:
            self.weight = self._shard(full_w, row_dim=1, col_dim=1)
            self._tied = ()
        if full_b is None:
            self.register_parameter("bias", None)
        else:
            self.bias = self._shard(full_b, row_dim=None, col_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the tesseract: gathers the weight's column block over the grid
        column, sums the partial logits over the grid row."""
        _check_input(type(self).__name__, x, self.input_size_per_partition)
        g = self.groups
        weight = gather_param(replicated_param(self.weight, g.dep), -1, g.col)
        logits = reduce_over(F.linear(x, weight), g.row)
        if self.bias is None:
            return logits
        return logits + replicated_param(self.bias, g.xz)


class VocabParallelClassifier2p5D(ParallelModule2p5D):
    """Logits split over the classes (Colossal-AI's ``VocabParallelClassifier2p5D``):
    ``y = x W^T + b`` with the ``(num_classes, in)`` weight in ``q x q`` blocks (classes by the
    row index, features by the column index, the layout of
    :class:`~kolossos.nn.layer.parallel_2p5d.embedding.VocabParallelEmbedding2p5D`). Input
    ``(..., in/q)``; output ``(..., num_classes/q)``, class block ``j``.

    Args:
        in_features: size of each input sample.
        num_classes: number of classes (divisible by ``q``).
        weight: a ``VocabParallelEmbedding2p5D`` weight to share (tied).
        bias: whether to learn an additive bias.
        dtype: parameter dtype.
        weight_initializer: applied to the full weight (default: ``nn.Linear``'s).
        bias_initializer: applied to the full bias.
        groups: the tesseract's groups.
        device: parameter device.

    Example:
        >>> head = VocabParallelClassifier2p5D(64, 128, groups=groups)  # doctest: +SKIP
        >>> logits = head(x_blk)  # (B/(d*q), 128/q)  # doctest: +SKIP
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
        groups: Groups2p5D,
        device: Device = None,
    ) -> None:
        super().__init__()
        owner, q = type(self).__name__, groups.tesseract_dim
        self.input_size_per_partition = divide(in_features, q, "in_features", owner)
        self.hidden_size_per_partition = divide(num_classes, q, "num_classes", owner)
        check_initializer(owner, "weight_initializer", weight_initializer)
        check_initializer(owner, "bias_initializer", bias_initializer)
        self.groups = groups
        self.in_features, self.num_classes = in_features, num_classes
        inits = (weight_initializer, bias_initializer)
        full_w, full_b = _dense_linear(in_features, num_classes, bias, device, dtype, inits)
        if weight is not None:
            _tie(owner, weight, (num_classes, in_features), (0, 1))
            self.weight = weight
            self._tied: tuple[str, ...] = ("weight",)
        else:
            self.weight = self._shard(full_w, row_dim=0, col_dim=1)
            self._tied = ()
        if full_b is None:
            self.register_parameter("bias", None)
        else:
            self.bias = self._shard(full_b, row_dim=None, col_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the tesseract (see :func:`tesseract_matmul_nt`)."""
        _check_input(type(self).__name__, x, self.input_size_per_partition)
        out = tesseract_matmul_nt(x, self.weight, self.groups)
        if self.bias is None:
            return out
        return out + replicated_param(self.bias, self.groups.xz)
