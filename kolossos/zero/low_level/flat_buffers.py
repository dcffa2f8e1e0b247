"""Turning a group's parameters into views of one flat buffer (see ``partition.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["attach_grad_views", "flatten_params", "param_views"]


def param_views(flat: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """One view of ``flat`` per parameter of ``layout``, with the parameter's shape."""
    return [flat[s.offset : s.stop].view(s.shape) for s in layout.spans]


@torch.no_grad()
def flatten_params(
    params: Sequence[torch.Tensor], layout: FlatLayout, device: torch.device
) -> torch.Tensor:
    """Copy ``params`` into a new flat buffer and make each parameter's data a view of it.

    The parameters keep their identity (modules, hooks and the user's references still see
    them); only their storage changes. Padding is zero.

    Raises:
        TypeError: parameters of different dtypes, or not floating point.
    """
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1 or any(not p.is_floating_point() for p in params):
        found = ", ".join(sorted(str(d) for d in dtypes))
        raise TypeError(
            f"a parameter group mixes dtypes or holds non-floating parameters ({found}); ZeRO "
            "keeps one flat buffer per group: give every parameter of a group the same floating "
            "dtype (or pass forced_dtype / the plugin's precision)."
        )
    dtype = dtypes.pop() if dtypes else torch.float32
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for param, view in zip(params, param_views(flat, layout), strict=True):
        view.copy_(param.detach())
        param.data = view
    return flat


def attach_grad_views(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
    """Make each parameter's ``.grad`` its view of the flat gradient buffer, so autograd
    accumulates into the buffer in place. A gradient someone replaced is copied in first (a
    ``None`` one, e.g. after ``model.zero_grad()``, zeroes the view)."""
    for param, view in zip(params, views, strict=True):
        grad = param.grad
        if grad is view:
            continue
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        param.grad = view
