"""Full-tensor initialisation of the 2.5D layers.

Every rank draws the *full* tensor from the default generator (identical on every rank after
``kolossos.launch`` seeds them alike) and keeps its shard: the same seed gives the same full
matrix as the dense layer, and the depth replicas (and the copies of replicated biases) agree
without a broadcast. The price is one full-size temporary per parameter at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Initializer", "check_initializer", "full_init"]

Initializer = Callable[..., Any]
"""Colossal-AI's ``initializer(tensor, fan_in=..., fan_out=...)``, filling ``tensor`` in place."""


def check_initializer(owner: str, name: str, initializer: Initializer | None) -> None:
    """Raises ``TypeError`` unless ``initializer`` is ``None`` or callable."""
    if initializer is not None and not callable(initializer):
        raise TypeError(
            f"{owner}: {name}={initializer!r} must be a callable "
            "initializer(tensor, fan_in=..., fan_out=...), or None."
        )


def full_init(
    default: torch.Tensor,
    initializer: Initializer | None,
    *,
    fan_in: int,
    fan_out: int | None = None,
) -> torch.Tensor:
    """``default`` (the dense layer's own draws), or refilled by ``initializer`` with the full
    layer's fans (bias initializers get ``fan_in`` only, as in Colossal-AI)."""
    if initializer is None:
        return default
    fans = {"fan_in": fan_in} if fan_out is None else {"fan_in": fan_in, "fan_out": fan_out}
    with torch.no_grad():
        initializer(default, **fans)
    return default
