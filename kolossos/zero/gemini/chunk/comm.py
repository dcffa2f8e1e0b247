"""The two collectives of a chunk — gather the payload, reduce-scatter the gradient — done the
fastest way the backend allows.

With NCCL (or more than two ranks) they are ``all_gather_into_tensor`` and
``reduce_scatter_tensor``. Between **two gloo ranks** both become one point-to-point exchange
with the other rank: gloo's flat all-gather and reduce-scatter copy and move the data several
times slower than a send/receive of the same bytes (measured on the 2-core development machine
for ZeRO-1/2, see :mod:`kolossos.zero.low_level.comm`), and its reduce-scatter sends the whole
input where the peer needs only its half. Each rank then sends ``chunk_size / 2`` elements per
gather and per reduction, the bandwidth-optimal amount.

With **more than two gloo ranks** (host tensors) they become one ``broadcast`` per rank's slice
and one ``reduce`` per rank's slice to that rank: gloo's flat collectives are several times
slower than the same bytes in these calls (an 8 Mi-element fp32 chunk on 4 ranks of the 2-core
development machine: all-gather 113 ms against 36 ms for the broadcasts, reduce-scatter 175 ms
against 35 ms for the reduces, with a fifth to a third of the CPU time).

Transfers of one chunk use their own tags (gather and reduction apart), so a prefetch in flight
never matches another chunk's transfer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["ChunkComm", "Pending"]

# torch 2.13 renamed the flat collectives (the old names warn); 2.11 only has the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending:
    """Transfers in flight, then an optional finishing step, run once by :meth:`wait`."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None) -> None:
        self._works = works
        self._finish = finish

    def wait(self) -> None:
        """Block until every transfer is complete, then finish."""
        for work in self._works:
            work.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class ChunkComm:
    """Gather and reduce-scatter for the chunks of one process group.

    Args:
        group: the data-parallel group (``None``: the world).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        gloo = dist.is_initialized() and "gloo" in str(dist.get_backend(group)).lower()
        self.pairwise = gloo and self.world_size == 2
        """two gloo ranks: point-to-point exchanges instead of collectives (host tensors only:
        gloo sends and receives no accelerator memory)"""
        self.gloo = gloo
        self._global = [
            dist.get_global_rank(group, r) if group is not None else r
            for r in range(self.world_size)
        ]
        self.peer = -1
        if self.pairwise:
            other = 1 - self.rank
            self.peer = dist.get_global_rank(group, other) if group is not None else other

    def all_gather(
        self, payload: torch.Tensor, shard: torch.Tensor, tag: int, async_op: bool = False
    ) -> Pending | None:
        """Fill ``payload`` (``world_size`` equal slices) with every rank's ``shard``, in rank
        order (COLLECTIVE). With ``async_op`` the result is there after ``wait()`` of the
        returned :class:`Pending`; ``None`` when it is there already (one rank)."""
        if self.world_size == 1:
            payload.copy_(shard)
            return None
        host = self.gloo and payload.device.type == "cpu"
        if not host:
            work = _all_gather(payload, shard, group=self.group, async_op=async_op)
            return Pending([work]) if async_op else None
        size = shard.numel()
        mine = payload[self.rank * size : (self.rank + 1) * size]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        if self.pairwise:
            theirs = payload[(1 - self.rank) * size : (2 - self.rank) * size]
            pending = Pending(self._exchange(mine, theirs, 2 * tag))
        else:  # one broadcast per slice, from its rank
            pending = Pending([
                dist.broadcast(payload[r * size : (r + 1) * size], self._global[r], self.group,
                               async_op=True)
                for r in range(self.world_size)
            ])  # fmt: skip
        if async_op:
            return pending
        pending.wait()
        return None

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: int) -> None:
        """``out`` = this rank's slice of the sum of every rank's ``full`` (COLLECTIVE)."""
        if self.world_size == 1:
            out.copy_(full)
            return
        host = self.gloo and full.device.type == "cpu"
        if not host:
            _reduce_scatter(out, full, group=self.group)
            return
        size = out.numel()
        if not self.pairwise:  # one reduce per slice, to its rank (``full`` is clobbered)
            Pending([
                dist.reduce(full[r * size : (r + 1) * size], self._global[r], group=self.group,
                            async_op=True)
                for r in range(self.world_size)
            ]).wait()  # fmt: skip
            out.copy_(full[self.rank * size : (self.rank + 1) * size])
            return
        theirs = full[(1 - self.rank) * size : (2 - self.rank) * size]
        Pending(self._exchange(theirs, out, 2 * tag + 1)).wait()
        out.add_(full[self.rank * size : (self.rank + 1) * size])

    def _exchange(self, send: torch.Tensor, receive: torch.Tensor, tag: int) -> list[dist.Work]:
        """Send ``send`` to the other rank and receive its counterpart into ``receive``."""
        ops = [
            dist.P2POp(dist.isend, send, self.peer, self.group, tag),
            dist.P2POp(dist.irecv, receive, self.peer, self.group, tag),
        ]
        return list(dist.batch_isend_irecv(ops))
