"""Tensor transport between two pipeline ranks: the sends, receives and counters that
:class:`~kolossos.pipeline.p2p.PipelineP2P` (the executor's layer) and
:class:`~kolossos.pipeline.p2p_communication.PipelineP2PCommunication` (Colossal-AI's object
API) are built on.

* Sends are ``isend`` (several tensors of one message in one ``batch_isend_irecv``) and never
  block; their handles and buffers are kept until they complete or :meth:`P2PTransport.wait_sends`.
* Receives block. Messages between two ranks match in the order they were sent, on gloo and NCCL
  alike.
* :meth:`P2PTransport.exchange` sends to and receives from a peer in one batch (what NCCL needs
  when both sides send first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.accelerator import get_accelerator

__all__ = ["P2PStats", "P2PTransport"]


@dataclass
class P2PStats:
    """What this rank's point-to-point layer did (counters for tests and benchmarks)."""

    messages_sent: int = 0
    messages_received: int = 0
    metadata_sent: int = 0
    metadata_received: int = 0
    bytes_sent: int = 0
    by_peer: dict[int, int] = field(default_factory=dict)
    """bytes sent to each global rank"""


class P2PTransport:
    """Point-to-point tensor traffic of one rank inside one process group.

    Args:
        group: the process group (peers are given as global ranks); ``None``: the default group.
        device: where received tensors are allocated (default: the accelerator's device).

    Message counts (:attr:`stats`) are kept by the layers above; the transport counts bytes.
    """

    def __init__(
        self, group: ProcessGroup | None = None, *, device: torch.device | None = None
    ) -> None:
        if device is None:
            device = get_accelerator().get_current_device()
        self.group = group
        self.device = device
        self.stats = P2PStats()
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []

    def isend(self, dst: int, tensors: list[torch.Tensor]) -> None:
        """Send ``tensors`` to global rank ``dst`` as one message (non-blocking; the buffers are
        kept until the send completes)."""
        tensors = [t.contiguous() for t in tensors]
        if not tensors:
            return
        if len(tensors) == 1:
            work = dist.isend(tensors[0], dst, group=self.group)
            works = [work] if work is not None else []
        else:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, dst, self.group)
                                            for t in tensors])  # fmt: skip
        self._count(dst, tensors)
        self._pending.append((works, tensors))  # keep the buffers alive until sent
        self._prune()

    def recv(self, src: int, tensors: list[torch.Tensor]) -> None:
        """Receive one message from global rank ``src`` into ``tensors`` (blocking)."""
        # SYNC POINT: a rank waits for another only here and in exchange().
        if len(tensors) == 1:
            dist.recv(tensors[0], src, group=self.group)
        elif tensors:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, src, self.group)
                                                for t in tensors]):  # fmt: skip
                work.wait()

    def exchange(
        self,
        dst: int,
        send: list[torch.Tensor],
        src: int,
        recv: list[torch.Tensor],
    ) -> None:
        """Send ``send`` to ``dst`` and receive into ``recv`` from ``src`` in one batch, and wait
        for both (blocking)."""
        send = [t.contiguous() for t in send]
        ops = [dist.P2POp(dist.isend, t, dst, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, src, self.group) for t in recv]
        # SYNC POINT: both directions complete together.
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if send:
            self._count(dst, send)

    def wait_sends(self) -> None:
        """Wait until every send of this transport has completed."""
        for works, _ in self._pending:
            for work in works:
                work.wait()
        self._pending.clear()

    def _count(self, dst: int, tensors: list[torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.stats.bytes_sent += size
        self.stats.by_peer[dst] = self.stats.by_peer.get(dst, 0) + size

    def _prune(self) -> None:
        self._pending = [
            (works, ts) for works, ts in self._pending if not all(w.is_completed() for w in works)
        ]
