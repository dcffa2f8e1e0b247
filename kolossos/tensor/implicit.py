"""Let torch tensors mix with DTensors in one operator.

A model built on ColoParameters computes with DTensors, while its inputs, masks and buffers are
plain tensors. DTensor refuses such mixes unless *implicit replication* is on, which treats a
plain tensor as replicated on the mesh. :func:`enable_implicit_replication` switches it on for
the rest of the process (the model code must run unmodified, so no context manager can wrap it);
it is called when a tensor-parallel ColoParameter is made.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from torch.distributed.tensor.experimental import implicit_replication

__all__ = ["enable_implicit_replication"]

_ENTERED: list[AbstractContextManager[Any]] = []


def enable_implicit_replication() -> None:
    """Switch DTensor's implicit replication on for the rest of the process (idempotent)."""
    if not _ENTERED:
        ctx = implicit_replication()
        ctx.__enter__()
        _ENTERED.append(ctx)
