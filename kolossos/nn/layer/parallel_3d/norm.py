"""Layer normalisation over features split by the output group (:class:`LayerNorm3D`)."""

from __future__ import annotations

import torch
from torch import nn

from kolossos.nn.layer.parallel_3d._base import ParallelModule3D
from kolossos.nn.layer.parallel_3d._comm import all_reduce_both, sync_grad
from kolossos.nn.layer.parallel_3d.groups import Groups3D, divide_3d

__all__ = ["LayerNorm3D"]


class LayerNorm3D(ParallelModule3D):
    """``nn.LayerNorm`` of the last dimension of a ``(batch/q**2, ..., features/q)`` block.

    The mean and the variance are summed over the output group (two all-reduces of one number
    per row forward and two backward; the variance is taken about the mean, as ``nn.LayerNorm``
    does). The affine weight and bias are split by the output group and repeated on the input x
    weight plane, over which their gradients are summed.

    Args:
        normalized_shape: the feature size (divisible by ``q``); an int or a 1-tuple.
        eps: added to the variance (Colossal-AI's default ``1e-12``).
        bias: whether the layer has a bias.
        dtype: parameter dtype.
        groups: the groups of the input's layout (keyword-only).
        device: where the parameters live.

    Example:
        >>> norm = LayerNorm3D(256, groups=groups)  # doctest: +SKIP
        >>> norm(x).shape == x.shape  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float = 1e-12,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        groups: Groups3D,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, tuple):
            if len(normalized_shape) != 1:
                raise NotImplementedError(
                    f"LayerNorm3D normalises the last dimension only; got normalized_shape="
                    f"{normalized_shape}. Pass one int."
                )
            normalized_shape = normalized_shape[0]
        q = self._init_groups(groups).depth
        divide_3d(normalized_shape, q, "normalized_shape")
        self.normalized_shape, self.variance_epsilon = normalized_shape, eps
        splits = ((0, "output"),)
        ones = torch.ones(normalized_shape, device=device, dtype=dtype)
        self.weight = self._shard(ones, splits)
        if bias:
            self.bias = self._shard(torch.zeros_like(ones), splits)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_native_module(cls, module: nn.Module, groups: Groups3D) -> LayerNorm3D:
        """Build from an ``nn.LayerNorm`` over one dimension, slicing its affine parameters."""
        if not isinstance(module, nn.LayerNorm) or not module.elementwise_affine:
            raise TypeError(f"expected an affine nn.LayerNorm, got {module!r}.")
        shape = module.normalized_shape
        bias = module.bias is not None
        layer = cls(shape, module.eps, bias, module.weight.dtype, groups=groups)  # type: ignore[arg-type]
        layer.to(module.weight.device)
        layer.load_full_state(module.state_dict())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.normalized_shape
        group = self.groups.output
        mean = all_reduce_both(x.sum(dim=-1, keepdim=True), group) / n  # SYNC POINT
        centred = x - mean
        var = all_reduce_both(centred.square().sum(dim=-1, keepdim=True), group) / n  # SYNC POINT
        out = centred * torch.rsqrt(var + self.variance_epsilon)
        out = out * sync_grad(self.weight, self.groups.input_x_weight)
        if self.bias is not None:
            out = out + sync_grad(self.bias, self.groups.input_x_weight)
        return out

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.variance_epsilon}, depth={self.depth}"
