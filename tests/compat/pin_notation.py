"""The notation of the signature pins (``tests/compat/test_api_signatures*.py``).

A pin lists a callable's parameters in order as ``name`` (required), ``name=<repr of default>``,
``*name`` (keyword-only), ``*args`` / ``**kwargs``; ``self`` is left out.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["P", "describe", "resolve"]


def describe(fn: Callable[..., Any]) -> list[str]:
    """The parameters of ``fn`` (without ``self``) in pin notation."""
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if name == "self":
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{name}")
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{name}")
        else:
            text = name if p.default is p.empty else f"{name}={p.default!r}"
            out.append(f"*{text}" if p.kind is p.KEYWORD_ONLY else text)
    return out


def P(spec: str) -> list[str]:
    """A pin written as one space-separated string (``|`` stands for a space inside an entry,
    as in a tuple default)."""
    return [item.replace("|", " ") for item in spec.split()]


def resolve(dotted: str) -> Any:
    """The object at ``package.module.attribute`` (the longest importable module prefix)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)
