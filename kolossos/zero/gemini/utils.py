"""``get_static_torch_model``: a plain ``nn.Module`` copy of a Gemini model, with full weights."""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.nn as nn

from kolossos.zero.gemini.gemini_ddp import GeminiDDP

__all__ = ["get_static_torch_model"]

_CPU = torch.device("cpu")


def get_static_torch_model(
    zero_ddp_model: GeminiDDP,
    device: torch.device | str = _CPU,
    dtype: torch.dtype = torch.float32,
    only_rank_0: bool = True,
) -> nn.Module:
    """A plain copy of ``zero_ddp_model``'s module with full parameters (COLLECTIVE).

    The copy has the module tree of the wrapped model (each submodule a shallow copy: same
    attributes and user hooks, without Gemini's hooks), its parameters are new ``Parameter``
    objects holding the full fp32 masters cast to ``dtype`` on ``device`` (tied parameters stay
    tied), and its persistent and non-persistent buffers are copies moved to ``device``
    (floating ones cast to ``dtype``). The Gemini model is not changed and keeps training; the
    copy is for saving, evaluation or numerical checks.

    Args:
        zero_ddp_model: the Gemini model.
        device: where the copy's tensors live.
        dtype: the floating dtype of the copy's parameters and buffers.
        only_rank_0: only the group's first rank gets the values; the other ranks' copy has
            empty parameters. ``False``: every rank gets them.

    Raises:
        TypeError: ``zero_ddp_model`` is not a ``GeminiDDP``.

    Example:
        >>> torch_model = get_static_torch_model(gemini_model, only_rank_0=False)
        >>> torch_model(x)  # doctest: +SKIP
    """
    if not isinstance(zero_ddp_model, GeminiDDP):
        raise TypeError(
            f"get_static_torch_model needs a GeminiDDP model, got {type(zero_ddp_model).__name__}."
        )
    state = zero_ddp_model.state_dict(only_rank_0=only_rank_0)
    drop = zero_ddp_model.hooks.handle_ids
    copies: dict[nn.Module, nn.Module] = {}
    made: dict[nn.Parameter, nn.Parameter] = {}
    source = zero_ddp_model.module
    for prefix, module in reversed(list(source.named_modules())):  # children first
        new = copy.copy(module)
        for key, value in vars(module).items():  # own hook dicts, without Gemini's hooks
            if "hooks" in key and isinstance(value, dict):
                setattr(new, key, OrderedDict((k, v) for k, v in value.items() if k not in drop))
        new._modules = OrderedDict(
            (name, None if child is None else copies[child])
            for name, child in module._modules.items()
        )
        new._parameters = OrderedDict()
        for name, param in module._parameters.items():
            if param is not None and param not in made:
                value = state[f"{prefix}.{name}" if prefix else name]
                made[param] = nn.Parameter(
                    value.to(device=device, dtype=dtype), requires_grad=param.requires_grad
                )
            new._parameters[name] = None if param is None else made[param]
        new._buffers = OrderedDict(
            (name, None if buf is None else _moved(buf, device, dtype))
            for name, buf in module._buffers.items()
        )
        copies[module] = new
    return copies[source]


def _moved(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    target = dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device=device, dtype=target, copy=True)
