"""``DistCoordinator``: who am I in the job, and helpers to run code on some ranks only."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

P = ParamSpec("P")
R = TypeVar("R")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class DistCoordinator:
    """Rank information and coordination helpers; works (as a one-process job) without a process
    group too.

    Attributes are read when the object is created: ``rank``, ``world_size``, ``local_rank`` (from
    ``LOCAL_RANK``, else the rank modulo the processes per node).

    Example:
        >>> coordinator = DistCoordinator()
        >>> coordinator.print_on_master("only rank 0 prints this")
        only rank 0 prints this
    """

    def __init__(self) -> None:
        self.rank = dist.get_rank() if _initialized() else 0
        self.world_size = dist.get_world_size() if _initialized() else 1
        local = os.environ.get("LOCAL_RANK")
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.local_rank = int(local) if local is not None else self.rank % max(per_node, 1)

    @staticmethod
    def _rank_in(pg: ProcessGroup | None) -> int:
        return dist.get_rank(pg) if _initialized() else 0

    @staticmethod
    def _size_of(pg: ProcessGroup | None) -> int:
        return dist.get_world_size(pg) if _initialized() else 1

    def is_master(self, pg: ProcessGroup | None = None) -> bool:
        """Whether this process is rank 0 of ``pg`` (default: the whole job)."""
        return self._rank_in(pg) == 0

    def is_node_master(self) -> bool:
        """Whether this process is local rank 0 on its node."""
        return self.local_rank == 0

    def is_last_process(self, pg: ProcessGroup | None = None) -> bool:
        """Whether this process is the last rank of ``pg`` (default: the whole job)."""
        return self._rank_in(pg) == self._size_of(pg) - 1

    def print_on_master(self, msg: str) -> None:
        """Print on global rank 0 only."""
        if self.is_master():
            print(msg, flush=True)

    def print_on_node_master(self, msg: str) -> None:
        """Print on local rank 0 of every node."""
        if self.is_node_master():
            print(msg, flush=True)

    def block_all(self, pg: ProcessGroup | None = None) -> None:
        """Barrier over ``pg`` (default: the whole job); a no-op without a process group."""
        if _initialized():
            dist.barrier(group=pg)  # SYNC POINT

    @contextmanager
    def priority_execution(
        self, executor_rank: int = 0, pg: ProcessGroup | None = None
    ) -> Iterator[None]:
        """Run the body on ``executor_rank`` first; the other ranks run it after it finished.

        Typical use: one rank downloads or preprocesses a data set, the others then read the cache.

        Example:
            >>> with DistCoordinator().priority_execution():
            ...     pass  # e.g. dataset = CIFAR10(root, download=True)
        """
        size = self._size_of(pg)
        if not 0 <= executor_rank < size:
            raise ValueError(f"executor_rank={executor_rank} must lie in [0, {size}).")
        first = self._rank_in(pg) == executor_rank
        if not first:
            self.block_all(pg)
        try:
            yield
        finally:
            if first:
                self.block_all(pg)

    def on_master_only(
        self, pg: ProcessGroup | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
        """Decorator: the function runs on rank 0 of ``pg`` only and returns ``None`` elsewhere."""

        def decorator(fn: Callable[P, R]) -> Callable[P, R | None]:
            @functools.wraps(fn)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
                return fn(*args, **kwargs) if self.is_master(pg) else None

            return wrapper

        return decorator

    def destroy(self, pg: ProcessGroup | None = None) -> None:
        """Destroy ``pg`` (default: the whole job's process group)."""
        if _initialized():
            dist.destroy_process_group(pg)

    def __repr__(self) -> str:
        return (
            f"DistCoordinator(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank})"
        )


@contextmanager
def priority_execution(executor_rank: int = 0, pg: ProcessGroup | None = None) -> Iterator[Any]:
    """Module-level form of :meth:`DistCoordinator.priority_execution` (as the docs import it)."""
    with DistCoordinator().priority_execution(executor_rank, pg):
        yield
