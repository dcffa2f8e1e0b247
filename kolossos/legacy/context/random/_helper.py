"""Seed switching per parallel mode: ``with seed(ParallelMode.TENSOR): dropout(...)`` draws from
the tensor-parallel stream (different per tensor rank), ``ParallelMode.DATA`` from the stream
shared by every rank."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kolossos.accelerator import get_accelerator
from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.context.random.seed_manager import SeedManager
from kolossos.moe import context as moe

__all__ = [
    "add_seed",
    "get_current_mode",
    "get_seeds",
    "get_states",
    "moe_set_seed",
    "reset_seeds",
    "seed",
    "set_mode",
    "set_seed_states",
    "sync_states",
    "with_seed",
]

F = TypeVar("F", bound=Callable[..., Any])
_SEED_MANAGER = SeedManager()


def get_seeds() -> dict[Hashable, int]:
    """mode -> seed of every seeded mode."""
    return _SEED_MANAGER.seeds


def get_states(copy: bool = False) -> dict[Hashable, torch.Tensor]:
    """mode -> saved generator state (cloned when ``copy``)."""
    states = _SEED_MANAGER.seed_states
    return {m: s.clone() for m, s in states.items()} if copy else states


def get_current_mode() -> Hashable | None:
    """The mode whose stream the generator draws from now."""
    return _SEED_MANAGER.current_mode


def add_seed(parallel_mode: Hashable, seed: int, overwrite: bool = False) -> None:
    """Give ``parallel_mode`` its own stream, started from ``seed``.

    Raises:
        ValueError: the mode has a seed already and ``overwrite`` is False.
    """
    _SEED_MANAGER.add_seed(parallel_mode, seed, overwrite)


def set_mode(parallel_mode: Hashable | None) -> None:
    """Switch the generator to ``parallel_mode``'s stream (saving the current one)."""
    _SEED_MANAGER.set_mode(parallel_mode)


def set_seed_states(parallel_mode: Hashable, state: torch.Tensor) -> None:
    """Replace the saved state of ``parallel_mode``."""
    _SEED_MANAGER.set_state(parallel_mode, state)


def sync_states() -> None:
    """Save the generator's state into the current mode's slot."""
    mode = get_current_mode()
    if mode is not None:
        set_seed_states(mode, get_accelerator().get_rng_state())


@contextmanager
def seed(parallel_mode: Hashable) -> Iterator[None]:
    """Draw from ``parallel_mode``'s stream inside the block, then switch back.

    Example:
        >>> with seed(ParallelMode.TENSOR):  # doctest: +SKIP
        ...     out = torch.nn.functional.dropout(x, 0.1)
    """
    previous = _SEED_MANAGER.current_mode
    outside = get_accelerator().get_rng_state() if previous is None else None
    _SEED_MANAGER.set_mode(parallel_mode)
    try:
        yield
    finally:
        _SEED_MANAGER.set_mode(previous)
        if outside is not None:  # no mode was active: give the generator its own state back
            get_accelerator().set_rng_state(outside)


def with_seed(func: F, parallel_mode: Hashable) -> F:
    """``func`` run inside ``seed(parallel_mode)``."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with seed(parallel_mode):
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def moe_set_seed(seed: int) -> None:
    """Seed the MoE experts (:func:`kolossos.moe.moe_set_seed`: expert ``g`` starts from
    ``seed + g``, so the experts differ per rank yet match at any expert-parallel size), and
    give every rank its own ``TENSOR`` stream, ``seed + global rank``, as Colossal-AI does."""
    moe.moe_set_seed(seed)
    rank = dist.get_rank() if dist.is_initialized() else 0
    add_seed(ParallelMode.TENSOR, seed + rank, True)


def reset_seeds() -> None:
    """Forget every mode's seed."""
    _SEED_MANAGER.reset()
