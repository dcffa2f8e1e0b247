"""Layer normalisation over features split by the grid's column index (Colossal-AI's
``LayerNorm2p5D``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_2p5d._comm import replicated_param
from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D, divide
from kolossos.nn.layer.parallel_2p5d.sharding import ParallelModule2p5D

__all__ = ["LayerNorm2p5D"]


def _row_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x`` summed over the last dimension and over the grid row (the full feature width)."""
    out = x.sum(dim=-1, keepdim=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)  # SYNC POINT
    return out


class _Normalize(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps)`` with the moments over features split across ``group``.

    Two passes (mean, then the centred second moment) for the same rounding as a dense layer
    norm; backward: ``(g - mean(g) - xhat * mean(g * xhat)) / sigma``, the means over the full
    width (one all-reduce of both sums).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, width: int, eps: float, group: ProcessGroup
    ) -> torch.Tensor:
        mean = _row_sum(x, group) / width
        centred = x - mean
        var = _row_sum(centred * centred, group) / width
        inv_std = torch.rsqrt(var + eps)
        xhat = centred * inv_std
        ctx.save_for_backward(xhat, inv_std)
        ctx.width, ctx.group = width, group
        return xhat

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xhat, inv_std = ctx.saved_tensors
        sums = torch.cat(
            [grad.sum(dim=-1, keepdim=True), (grad * xhat).sum(dim=-1, keepdim=True)], dim=-1
        )
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(sums, group=ctx.group)  # SYNC POINT
        sums = sums / ctx.width
        grad_x = (grad - sums[..., :1] - xhat * sums[..., 1:]) * inv_std
        return grad_x, None, None, None


class LayerNorm2p5D(ParallelModule2p5D):
    """``nn.LayerNorm(normalized_shape)`` on activation blocks ``(..., normalized_shape/q)``:
    the moments are reduced over the grid row; the affine weight and bias are split by the
    column index (their gradients are summed over the batch blocks).

    Args:
        normalized_shape: the full feature width (an int; divisible by ``q``).
        eps: added to the variance.
        bias: whether to learn an additive bias.
        dtype: parameter dtype.
        groups: the tesseract's groups.
        device: parameter device.

    Example:
        >>> norm = LayerNorm2p5D(256, groups=groups)  # doctest: +SKIP
        >>> y = norm(x_blk)  # x_blk: (..., 128) for q = 2  # doctest: +SKIP
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-05,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        groups: Groups2p5D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if isinstance(normalized_shape, bool) or not isinstance(normalized_shape, int):
            raise TypeError(
                f"{owner}: normalized_shape={normalized_shape!r} must be an int (the last "
                "dimension's full size)."
            )
        self.partitioned_partition = divide(
            normalized_shape, groups.tesseract_dim, "normalized_shape", owner
        )
        self.groups = groups
        self.normalized_shape, self.variance_epsilon = normalized_shape, eps
        ones = torch.ones(normalized_shape, device=device, dtype=dtype)
        self.weight = self._shard(ones, row_dim=None, col_dim=0)
        if bias:
            self.bias = self._shard(torch.zeros_like(ones), row_dim=None, col_dim=0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the grid row (and the ``xz`` group in backward)."""
        if x.shape[-1] != self.partitioned_partition:
            raise ValueError(
                f"{type(self).__name__}: the input's last dimension is {x.shape[-1]}, expected "
                f"this rank's feature block of {self.partitioned_partition}."
            )
        g = self.groups
        xhat = _Normalize.apply(x, self.normalized_shape, self.variance_epsilon, g.row)
        out = xhat * replicated_param(self.weight, g.xz)
        if self.bias is not None:
            out = out + replicated_param(self.bias, g.xz)
        return out

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.variance_epsilon}"
