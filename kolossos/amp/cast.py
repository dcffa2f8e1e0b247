"""``cast_floating``: the one helper that casts the floating-point tensors of nested inputs and
outputs (tuples, lists, dicts, named tuples, Hugging Face ``ModelOutput``) to a working dtype."""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["cast_floating"]


def cast_floating(value: Any, dtype: torch.dtype, device: torch.device | None = None) -> Any:
    """``value`` with every floating-point tensor inside cast to ``dtype`` (and, with ``device``,
    every tensor moved there). Containers are rebuilt with their own type — a dict subclass such
    as a ``ModelOutput`` stays one, a named tuple stays one — and the input is never modified.
    Integer tensors (token ids, labels) keep their dtype; other objects are returned as they are.

    Example:
        >>> out = cast_floating({"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)},
        ...                     torch.bfloat16)
        >>> out["x"].dtype, out["ids"].dtype
        (torch.bfloat16, torch.int64)
    """
    if isinstance(value, torch.Tensor):
        if device is not None:
            value = value.to(device)
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, dict):
        out = copy.copy(value)
        for key in list(value.keys()):
            out[key] = cast_floating(value[key], dtype, device)
        return out
    if isinstance(value, (list, tuple)):
        items = [cast_floating(v, dtype, device) for v in value]
        if isinstance(value, tuple) and hasattr(type(value), "_make"):  # a named tuple
            return type(value)._make(items)  # type: ignore[attr-defined]
        return type(value)(items)
    return value
