"""Small helpers shared by the model and optimizer save paths."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, TypeVar

__all__ = ["MiB", "boosted", "check_save_args", "drain"]

T = TypeVar("T")

MiB = 1024 * 1024


def check_save_args(checkpoint: Any, size_per_shard: Any, prefix: Any) -> int:
    """Validate common save arguments; return the shard limit in bytes."""
    if not isinstance(checkpoint, (str, os.PathLike)) or not str(checkpoint):
        raise TypeError(f"checkpoint={checkpoint!r} must be a path (str or os.PathLike).")
    if isinstance(size_per_shard, bool) or not isinstance(size_per_shard, (int, float)):
        raise TypeError(f"size_per_shard={size_per_shard!r} must be a number of MB, e.g. 1024.")
    if not size_per_shard > 0:
        raise ValueError(f"size_per_shard={size_per_shard!r} must be a positive number of MB.")
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"prefix={prefix!r} must be a string or None.")
    return max(1, int(size_per_shard * MiB))


def drain(items: Iterator[Any]) -> None:
    """Run an iterator to its end (a gathering hook must finish its collectives on every rank)."""
    for _ in items:
        pass


def boosted(value: Any, cls: type[T], io: str, plugin: str, what: str) -> T:
    """``value`` if it is a ``cls`` (what ``booster.boost`` returns with ``plugin``).

    Raises:
        TypeError: anything else, naming the checkpoint IO and the plugin.
    """
    if not isinstance(value, cls):
        raise TypeError(
            f"{io} saves and loads the {what} returned by booster.boost with {plugin} (a "
            f"{cls.__name__}), got {type(value).__name__}."
        )
    return value
