"""The two collectives ZeRO-1/2 needs, each done the fastest way the backend allows.

* **Reduce to owner** (gradients): every rank holds a bucket; the owner of its flat range must
  end up with the sum. With NCCL this is ``dist.reduce``. On gloo, ``dist.reduce`` and
  ``reduce_scatter_tensor`` move data several times slower than a point-to-point transfer (about
  170 ms and 350 ms against 30-60 ms for 48 MB between two CPU ranks, measured on the 2-core
  development machine), so with two ranks the other rank sends its bucket and the owner adds it
  into its own; with more ranks gloo's ``reduce`` is used.
* **Gather partitions** (updated parameters): every rank's partition of the flat working buffer
  goes to every rank, in place. NCCL: ``all_gather_into_tensor`` with the input aliasing its slot
  of the output. gloo: one ``broadcast`` per owner (``all_gather_into_tensor`` is 5-10 times
  slower there).

Both return handles so that communication overlaps with computation until ``wait()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["Communicator", "Handle"]


class Handle(Protocol):
    """An operation in flight."""

    def wait(self) -> None:
        """Block until the operation is complete (and its result in place)."""

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return at once."""


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _Works:
    """Handles of several ``torch.distributed`` works, then an optional finishing step."""

    def __init__(
        self,
        works: list[Any],
        finish: Callable[[], None] | None = None,
        inner: list[Handle] | None = None,
    ) -> None:
        self._works = [w for w in works if w is not None] + list(inner or [])
        self._finish = finish

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class Communicator:
    """Reduce-to-owner and partition gathers over one data-parallel process group.

    Args:
        group: the data-parallel group (``None``: the world).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        backend = str(dist.get_backend(group)).lower()
        self.gloo = "gloo" in backend
        self._global = [
            dist.get_global_rank(group, r) if group is not None else r
            for r in range(self.world_size)
        ]

    def global_rank(self, rank: int) -> int:
        """The world rank of ``rank`` of the group."""
        return self._global[rank]

    @property
    def pairwise(self) -> bool:
        """Two gloo ranks: reductions are point-to-point transfers (see the module doc)."""
        return self.gloo and self.world_size == 2

    def reduce_to_owner(
        self, tensor: torch.Tensor, owner: int, tag: int, scratch: torch.Tensor | None
    ) -> Handle:
        """Sum ``tensor`` over the ranks into the owner's ``tensor`` (asynchronously).

        Non-owners' ``tensor`` holds undefined values afterwards. In :attr:`pairwise` mode the
        owner passes ``scratch`` (same size and dtype) to receive the other rank's part.

        Args:
            tensor: this rank's contribution; the result on the owner.
            owner: rank of the group receiving the sum.
            tag: distinguishes concurrent point-to-point transfers (e.g. the bucket index).
            scratch: receive buffer of the owner in pairwise mode, else ``None``.
        """
        if self.world_size == 1:
            return _Done()
        if not self.pairwise:
            dst = self.global_rank(owner)
            return _Works([dist.reduce(tensor, dst, group=self.group, async_op=True)])
        if self.rank != owner:
            return _Works([dist.isend(tensor, self.global_rank(owner), self.group, tag)])
        assert scratch is not None and scratch.shape == tensor.shape
        receive = self.receive_from_peer(scratch, tag)

        def add_received() -> None:
            receive.wait()
            tensor.add_(scratch)

        return _Works([], add_received, [receive])

    def receive_from_peer(self, buffer: torch.Tensor, tag: int) -> Handle:
        """Pairwise mode: receive the other rank's contribution into ``buffer`` (the owner's
        side of :meth:`reduce_to_owner` when it keeps its own part elsewhere)."""
        assert self.pairwise
        peer = self.global_rank(1 - self.rank)
        return _Works([dist.irecv(buffer, peer, self.group, tag)])

    def gather_partitions(self, flat: torch.Tensor) -> Handle:
        """Fill every rank's ``flat`` with all ranks' partitions (asynchronously).

        ``flat`` has ``world_size * S`` elements; rank ``r`` contributes ``flat[r*S:(r+1)*S]``.
        """
        if self.world_size == 1 or flat.numel() == 0:
            return _Done()
        size = flat.numel() // self.world_size
        if not self.gloo:
            mine = flat[self.rank * size : (self.rank + 1) * size]
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return _Works([gather(flat, mine, self.group, async_op=True)])
        works = [
            dist.broadcast(
                flat[r * size : (r + 1) * size], self.global_rank(r), self.group, async_op=True
            )
            for r in range(self.world_size)
        ]
        return _Works(works)

    def gather_range(self, flat: torch.Tensor, layout: FlatLayout, start: int, stop: int) -> Handle:
        """Fill every rank's ``flat[start:stop]`` from its owners (asynchronously): one
        broadcast per owner of a piece of the range (``overlap_allgather``'s buckets)."""
        if self.world_size == 1 or stop <= start:
            return _Done()
        works = [
            dist.broadcast(flat[lo:hi], self.global_rank(owner), self.group, async_op=True)
            for owner, lo, hi in layout.owners(start, stop)
        ]
        return _Works(works)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` from rank ``src`` of the group (blocking)."""
        if self.world_size > 1:
            dist.broadcast(tensor, self.global_rank(src), self.group)
