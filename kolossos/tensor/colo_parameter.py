"""``ColoParameter``: a :class:`~kolossos.tensor.ColoTensor` that is a module parameter.

It is to ColoTensor what ``nn.Parameter`` is to ``torch.Tensor``: assigned to a module it is
registered, and ``parameters()`` / ``named_parameters()`` yield it. Its gradient is kept in the
parameter's own placements (a replicated gradient of a sharded weight is cut to this rank's
piece after accumulation), so optimizers update the pieces in place.

Example:
    >>> w = ColoParameter(torch.randn(4, 4), spec=ColoTensorSpec(pg))  # doctest: +SKIP
    >>> linear.weight = w  # doctest: +SKIP
    >>> any(p is w for p in linear.parameters())  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from kolossos.tensor.colo_tensor import ColoTensor
from kolossos.tensor.implicit import enable_implicit_replication
from kolossos.tensor.tensor_spec import ColoTensorSpec

__all__ = ["ColoParameter"]


def _grad_to_param_placements(param: torch.Tensor) -> None:
    grad = param.grad
    if (
        isinstance(param, DTensor)
        and isinstance(grad, DTensor)
        and tuple(grad.placements) != tuple(param.placements)
    ):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


class ColoParameter(ColoTensor):
    """A parameter whose payload is spread over the tensor-parallel group.

    Args:
        data: this rank's piece (with ``spec``), or a ColoTensor / DTensor.
        requires_grad: whether it is trained.
        spec: the process group and specs of a plain ``data`` tensor.

    Raises:
        TypeError: a plain ``data`` tensor without a ``ColoTensorSpec``.
    """

    _is_param = True

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = True,
        spec: ColoTensorSpec | None = None,
    ) -> ColoParameter:
        if data is None:
            data = torch.empty(0)
        enable_implicit_replication()
        if not isinstance(data, DTensor):
            data = ColoTensor.from_torch_tensor(data.detach(), spec)
        out: Any = DTensor.__new__(
            cls, data._local_tensor.detach(), data._spec, requires_grad=requires_grad
        )
        out._pg = data._pg if isinstance(data, ColoTensor) else None
        out.compute_spec = data.compute_spec if isinstance(data, ColoTensor) else None
        if requires_grad:
            out.register_post_accumulate_grad_hook(_grad_to_param_placements)
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def from_torch_tensor(  # type: ignore[override]
        tensor: torch.Tensor, requires_grad: bool = True, spec: ColoTensorSpec | None = None
    ) -> ColoParameter:
        """A ColoParameter holding ``tensor`` as this rank's piece."""
        return ColoParameter(tensor, requires_grad=requires_grad, spec=spec)

    def detach(self) -> Any:
        out: Any = DTensor.__new__(
            ColoParameter, self._local_tensor.detach(), self._spec, requires_grad=False
        )
        out._pg, out.compute_spec = self._pg, self.compute_spec
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        out = ColoParameter(super().__deepcopy__(memo), requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto: Any) -> Any:
        raise TypeError(
            "a ColoParameter cannot be pickled (it holds process groups); save "
            "kolossos.tensor.d_tensor.to_global(param) or the model's state_dict()."
        )
