"""Layer normalisation of 2D tensor parallelism: :class:`LayerNorm2D`.

The input block ``[..., H/q]`` on rank ``(i, j)`` holds feature block ``j`` of batch block ``i``,
so the statistics of a row need the ``q`` ranks of grid row ``i``: one all-reduce of the sums for
the mean, one of the centred squares for the variance (two passes, as precise as the dense
layer), and in backward one all-reduce of ``[sum dy, sum dy * x̂]``. The scale and shift are
spread like a bias (``[H/q²]``, piece ``i`` of feature block ``j``), all-gathered over the
column group before use.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kolossos.nn.layer.parallel_2d._base import ParallelModule2D
from kolossos.nn.layer.parallel_2d._comm import gather_weight_2d
from kolossos.nn.layer.parallel_2d.grid import Groups2D, check_divisible

__all__ = ["LayerNorm2D", "layer_norm_2d"]


def _row_sum(x: torch.Tensor, groups: Groups2D) -> torch.Tensor:
    out = x.sum(dim=-1, keepdim=True)
    if groups.q > 1:
        dist.all_reduce(out, group=groups.row)  # SYNC POINT: the feature blocks of a row
    return out


class _Normalize2D(torch.autograd.Function):
    """``x̂ = (x - mean) / sqrt(var + eps)`` over features split across the row group."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, groups: Groups2D, hidden: int, eps: float
    ) -> torch.Tensor:
        mean = _row_sum(x, groups) / hidden
        centred = x - mean
        var = _row_sum(centred * centred, groups) / hidden
        inv_std = torch.rsqrt(var + eps)
        x_hat = centred * inv_std
        ctx.save_for_backward(x_hat, inv_std)
        ctx.groups, ctx.hidden = groups, hidden
        return x_hat

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, inv_std = ctx.saved_tensors
        sums = torch.cat(
            [grad.sum(dim=-1, keepdim=True), (grad * x_hat).sum(dim=-1, keepdim=True)], dim=-1
        )
        if ctx.groups.q > 1:
            dist.all_reduce(sums, group=ctx.groups.row)  # SYNC POINT
        mean_grad, mean_grad_x = (sums / ctx.hidden).split(1, dim=-1)
        dx = (grad - mean_grad - x_hat * mean_grad_x) * inv_std
        return dx, None, None, None


def layer_norm_2d(x: torch.Tensor, groups: Groups2D, hidden: int, eps: float) -> torch.Tensor:
    """Normalise a feature-split input block over all ``hidden`` features (no affine part).
    COLLECTIVE over the row group, forward and backward."""
    out: torch.Tensor = _Normalize2D.apply(x, groups, hidden, eps)
    return out


class LayerNorm2D(ParallelModule2D):
    """``nn.LayerNorm(normalized_shape)`` over a 2D input block ``[..., H/q]``.

    Args:
        normalized_shape: the full feature size ``H`` (divisible by ``q²``).
        eps: added to the variance.
        bias: whether there is a shift (``False``: scale only).
        dtype: parameter dtype.
        groups: the grid.
        device: where the parameters live.

    Example:
        >>> norm = LayerNorm2D(64, groups=groups)  # doctest: +SKIP
        >>> norm(x_ij).shape == x_ij.shape  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-05,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        groups: Groups2D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._init_groups(groups)
        name, q = type(self).__name__, self.groups.q
        if not isinstance(normalized_shape, int) or isinstance(normalized_shape, bool):
            raise TypeError(
                f"{name}: normalized_shape={normalized_shape!r} must be an int (the last "
                "dimension's full size); 2D layer norm normalises the last dimension only."
            )
        self.partitioned_partition = check_divisible(
            name, "normalized_shape", normalized_shape, q * q
        )
        self.normalized_shape, self.variance_epsilon = normalized_shape, eps
        factory = {"device": device, "dtype": dtype}
        splits = ((0, "row"), (0, "col"))
        self.weight = self._block(torch.ones(normalized_shape, **factory), splits)  # type: ignore[arg-type]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = self._block(torch.zeros(normalized_shape, **factory), splits)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the row and column groups."""
        x_hat = layer_norm_2d(x, self.groups, self.normalized_shape, self.variance_epsilon)
        scale = gather_weight_2d(self.weight, self.groups)
        if self.bias is None:
            return x_hat * scale
        return torch.addcmul(gather_weight_2d(self.bias, self.groups), x_hat, scale)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.variance_epsilon}, q={self.groups.q}"
