"""ZeRO's two transfers through shared memory, for gloo ranks on one host.

Each rank owns ``slots`` slots of ``slot_bytes`` in its shared segment
(:class:`~kolossos.cluster.host_shm.HostSegments`).

**Reduce to owner** (:meth:`SharedTransport.send`, :meth:`SharedTransport.receive`), one bucket:

* a **sender** (not the owner) copies its part into a free slot of its own segment and sends the
  owner the slot's number (one ``int64``, tag ``2 * tag``); the slot stays taken until the owner
  answers (tag ``2 * tag + 1``) that it has read it;
* the **owner** receives every sender's slot number, adds each sender's slot, read in place from
  the sender's segment, into its own part, and answers each sender.

The payload never passes through a socket: the sender copies it once, the owner reads it once,
where gloo copies it into and out of the kernel on both sides (the messages that remain carry 8
bytes). A sender short of free slots must first complete its oldest bucket in flight (the
reducer does, in launch order, whether this rank owns that bucket or sends to its owner): buckets
are launched in the same order on every rank, so the oldest one always completes.

**Gather partitions** (:meth:`SharedTransport.gather`): every rank copies a piece of its
partition into a slot and tells every peer; each peer copies the piece into its own buffer and
answers; a slot is written again only once every peer has answered for it. One copy in, one copy
out per byte, where gloo's broadcasts pass every byte through a socket.

Slots take memory from their first use after :meth:`SharedTransport.release` until the next
:meth:`SharedTransport.release` (the reducer calls it when a backward pass has reduced everything),
so no shared memory is held between backward passes. While a
:class:`~kolossos.accelerator.memory_tracker.TensorMemoryTracker` is active, a slot in use is
counted as this rank's memory; what a rank reads from a peer's segment is the peer's.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from kolossos.accelerator.memory_tracker import active_tracker
from kolossos.cluster.host_shm import HostSegments
from kolossos.utils.profiling.comm_counter import count_transfer

__all__ = ["GATHER_TAG", "SharedTransport"]

#: message tags of the partition gathers start here (the reduction's are twice a bucket index)
GATHER_TAG = 1 << 29


class _Send:
    """A sender's bucket in flight: done when the owner has answered."""

    def __init__(self, works: list[Any], keep: list[torch.Tensor], on_done: Any) -> None:
        self._works = works
        self._keep = keep  # the messages' tensors, alive until their transfers end
        self._on_done = on_done

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._keep.clear()
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class _Receive:
    """The owner's bucket in flight: the senders' slot numbers, then the sum and the answers."""

    def __init__(self, works: list[Any], finish: Any) -> None:
        self._works = works
        self._finish = finish

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class SharedTransport:
    """Reduce-to-owner over shared segments (see the module doc).

    Args:
        segments: the group's shared segments (each ``slots * slot_bytes`` or larger).
        group: the process group the slot numbers travel on.
        global_ranks: the world rank of each rank of the group.
        slots: slots per rank.
        slot_bytes: bytes per slot (a multiple of the page size).
    """

    def __init__(
        self,
        segments: HostSegments,
        group: dist.ProcessGroup | None,
        global_ranks: list[int],
        slots: int,
        slot_bytes: int,
    ) -> None:
        assert slots * slot_bytes <= segments.nbytes
        self.segments = segments
        self.group = group
        self.rank = segments.rank
        self._global = global_ranks
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._free = list(reversed(range(slots)))
        self._held: dict[int, torch.Tensor] = {}  # slots with memory: their bytes, for trackers
        self._sends: deque[_Send] = deque()
        self._answers: list[tuple[Any, torch.Tensor]] = []
        self._base = segments.view(self.rank, 0, 1, torch.uint8).data_ptr()
        self._pg = group if group is not None else dist.group.WORLD  # for CommCounter

    @property
    def has_free_slot(self) -> bool:
        """Whether :meth:`send` can take a slot now."""
        return bool(self._free)

    def _slot(self) -> int:
        if not self._free:
            raise RuntimeError(
                "no free shared slot: complete the oldest bucket in flight first (the reducer "
                "does; waiting here could deadlock with an owner that waits for this rank)."
            )
        slot = self._free.pop()
        self._reserve(slot)
        return slot

    def _reserve(self, slot: int) -> None:
        """Give ``slot`` memory (once until :meth:`release`), counted by an active tracker."""
        if slot in self._held:
            return
        offset = slot * self.slot_bytes
        self.segments.reserve(offset, self.slot_bytes)
        held = self.segments.view(self.rank, offset, self.slot_bytes, torch.uint8)
        tracker = active_tracker("cpu")
        if tracker is not None:
            tracker.track(held)
        self._held[slot] = held

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A free slot as a buffer of ``numel`` elements to fill and then :meth:`send` without
        a copy, or ``None`` when no slot is free."""
        if not self._free:
            return None
        slot = self._slot()
        return self.segments.view(self.rank, slot * self.slot_bytes, numel, dtype)

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        """The slot ``tensor`` starts (a :meth:`buffer`), or ``None`` for other memory."""
        offset = tensor.data_ptr() - self._base
        if 0 <= offset < self.slots * self.slot_bytes and offset % self.slot_bytes == 0:
            return offset // self.slot_bytes
        return None

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return an unsent :meth:`buffer` (a backward pass that failed)."""
        slot = self.slot_of(tensor)
        if slot is not None and slot not in self._free:
            self._free.append(slot)

    def send(self, tensor: torch.Tensor, owner: int, tag: int) -> _Send:
        """Hand ``tensor`` (this rank's part: a :meth:`buffer`, or any memory, which is copied
        into a slot) to ``owner`` (a rank of the group)."""
        nbytes = tensor.numel() * tensor.element_size()
        assert nbytes <= self.slot_bytes, (nbytes, self.slot_bytes)
        slot = self.slot_of(tensor)
        if slot is None:
            slot = self._slot()
            view = self.segments.view(
                self.rank, slot * self.slot_bytes, tensor.numel(), tensor.dtype
            )
            view.copy_(tensor.reshape(-1))
        message, answer = torch.tensor([slot], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        dst = self._global[owner]
        works = [
            dist.isend(message, dst, self.group, 2 * tag),
            dist.irecv(answer, dst, self.group, 2 * tag + 1),
        ]
        count_transfer("send", nbytes, self._pg)
        handle = _Send(works, [message, answer], lambda: self._free.append(slot))
        self._sends.append(handle)
        return handle

    def receive(self, tensor: torch.Tensor, tag: int, dtype: torch.dtype) -> _Receive:
        """Add every other rank's part of this bucket (``dtype`` elements, as many as
        ``tensor`` has) into ``tensor`` (the owner's part), once the handle is waited on."""
        peers = [r for r in range(len(self._global)) if r != self.rank]
        works, messages = self._receive_all(peers, 2 * tag)

        def add_parts() -> None:
            flat = tensor.view(-1)
            for message, peer in zip(messages, peers, strict=True):
                offset = int(message.item()) * self.slot_bytes
                part = self.segments.view(peer, offset, flat.numel(), dtype)
                flat.add_(part)
                count_transfer("recv", part.numel() * part.element_size(), self._pg)
                answer = torch.zeros(1, dtype=torch.int64)
                self._answers.append(
                    (dist.isend(answer, self._global[peer], self.group, 2 * tag + 1), answer)
                )

        return _Receive(works, add_parts)

    def gather(self, flat: torch.Tensor) -> None:
        """Fill ``flat`` (``world_size * S`` elements) with every rank's partition: rank ``r``
        contributes ``flat[r*S:(r+1)*S]`` (blocking; every rank of the group calls it)."""
        world = len(self._global)
        size = flat.numel() // world
        piece = max(1, self.slot_bytes // flat.element_size())
        peers = [r for r in range(world) if r != self.rank]
        slots = self.slots
        assert len(self._free) == slots, "gather while buckets are in flight"
        answers: list[list[Any]] = []  # per piece: the peers' answers for its slot
        for k, lo in enumerate(range(0, size, piece)):
            numel, slot = min(piece, size - lo), k % slots
            if k >= slots:
                for work in answers[k - slots]:
                    work.wait()  # SYNC POINT: every peer has read the slot
                answers[k - slots] = []  # a gloo receive must not be waited on twice
            self._reserve(slot)
            mine = flat[self.rank * size + lo : self.rank * size + lo + numel]
            offset = slot * self.slot_bytes
            self.segments.view(self.rank, offset, numel, flat.dtype).copy_(mine)
            tag = GATHER_TAG + 2 * k
            signal = torch.zeros(1, dtype=torch.int64)
            sent = [dist.isend(signal, self._global[r], self.group, tag) for r in peers]
            waits, _ = self._receive_all(peers, tag)
            answers.append(self._receive_all(peers, tag + 1)[0])
            for work, r in zip(waits, peers, strict=True):
                work.wait()  # SYNC POINT: rank r's piece is in its slot
                start = r * size + lo
                flat[start : start + numel].copy_(self.segments.view(r, offset, numel, flat.dtype))
                answer = dist.isend(signal, self._global[r], self.group, tag + 1)
                self._answers.append((answer, signal))
            for work in sent:
                if work is not None:
                    work.wait()
        for works in answers:
            for work in works:
                work.wait()
        self.release()
        count_transfer("all_gather", flat.numel() * flat.element_size(), self._pg)

    def _receive_all(self, peers: list[int], tag: int) -> tuple[list[Any], list[torch.Tensor]]:
        """Post a one-``int64`` receive from each of ``peers`` (the works and the tensors)."""
        messages = [torch.empty(1, dtype=torch.int64) for _ in peers]
        works = [
            dist.irecv(m, self._global[r], self.group, tag)
            for m, r in zip(messages, peers, strict=True)
        ]
        return works, messages

    def release(self) -> None:
        """Wait for every bucket in flight, then give every slot's memory back."""
        while self._sends:
            self._sends.popleft().wait()
        for work, _ in self._answers:
            work.wait()
        self._answers.clear()
        for slot in self._held:
            self.segments.release(slot * self.slot_bytes, self.slot_bytes)
        self._held.clear()
