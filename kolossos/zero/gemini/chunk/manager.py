"""``ChunkManager``: packs parameters into chunks and moves, gathers and releases them.

The manager owns the chunk list (initialisation order), the map from parameter to its place, the
record of which chunks are gathered, and the bookkeeping of where chunk shards live that a
placement policy reads (``total_mem``) and changes (``move_chunk``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.zero.gemini.chunk.chunk import Chunk, TensorInfo
from kolossos.zero.gemini.chunk.comm import ChunkComm
from kolossos.zero.gemini.memory_tracer.scope import model_data_scope

__all__ = ["ChunkManager"]


class ChunkManager:
    """The chunks of one model.

    Args:
        named_params: ``(name, parameter)`` in initialisation order, each parameter once.
        chunk_size: capacity of a chunk in elements (rounded up to a multiple of the world
            size); a larger parameter gets a chunk of its own, the last chunk is cut to size.
        dtype: the working dtype.
        group: the data-parallel group.
        compute_device: where gathered payloads live.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        chunk_size: int,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        compute_device: torch.device,
        alone: Collection[nn.Parameter] = (),
    ) -> None:
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.group = group
        self.dtype = dtype
        self.compute_device = compute_device
        self.chunk_size = _round_up(max(chunk_size, 1), self.world_size)
        self.chunks: list[Chunk] = []
        self._where: dict[nn.Parameter, tuple[Chunk, TensorInfo]] = {}
        self.accessed_chunks: list[Chunk] = []  # gathered now, in the order they were gathered
        self.prefetches = 0  # asynchronous gathers issued ahead of use
        self.comm = ChunkComm(group)
        self._pack(named_params, alone)

    def _pack(
        self, named_params: Sequence[tuple[str, nn.Parameter]], alone: Collection[nn.Parameter]
    ) -> None:
        groups: list[list[tuple[str, nn.Parameter]]] = []
        cut: list[bool] = []  # chunk cut to its content: the last and those of a lone parameter
        lone = {id(p) for p in alone}
        room = 0
        for name, p in named_params:
            single = id(p) in lone
            if single or p.numel() > room or not groups:
                groups.append([])
                cut.append(single)
                room = max(self.chunk_size, p.numel())
            groups[-1].append((name, p))
            room = 0 if single else room - p.numel()
        if cut:
            cut[-1] = True
        for members, to_content in zip(groups, cut, strict=True):
            used = _round_up(sum(p.numel() for _, p in members), self.world_size)
            size = used if to_content else max(self.chunk_size, used)
            chunk = Chunk(len(self.chunks), size, self.dtype, self.group, self.compute_device,
                          comm=self.comm)  # fmt: skip
            for name, p in members:
                chunk.append(p, name)
                self._where[p] = (chunk, chunk.tensors[-1])
            self.chunks.append(chunk)

    @property
    def dp_degree_chunk_size_dict(self) -> dict[int, int]:
        """``{data-parallel degree: chunk size}``, as Colossal-AI's manager reports it (one
        degree: every parameter is replicated over the group)."""
        return {self.world_size: self.chunk_size}

    # ------------------------------------------------------------------ lookup
    def locate(self, param: torch.Tensor) -> tuple[Chunk, TensorInfo]:
        """The chunk holding ``param`` and its entry there."""
        return self._where[param]  # type: ignore[index]

    def manages(self, param: torch.Tensor) -> bool:
        """Whether ``param`` lives in a chunk."""
        return param in self._where

    def chunks_of(self, params: Iterable[torch.Tensor]) -> list[Chunk]:
        """The distinct chunks holding ``params``, in chunk order."""
        where: dict[Any, tuple[Chunk, TensorInfo]] = self._where
        found = {where[p][0].chunk_id for p in params if p in where}
        return [self.chunks[i] for i in sorted(found)]

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self.chunks)

    # ------------------------------------------------------------------ placement interface
    @property
    def total_mem(self) -> dict[str, int]:
        """Bytes of chunk data resident per device type: each chunk's working shard where
        ``device_type`` says (counted even while dropped: it is re-made there on the next
        gather) plus the gathered payloads on the compute device (a kept-gathered chunk's
        shard is a view of its payload and is not counted twice)."""
        mem: dict[str, int] = {"cpu": 0, self.compute_device.type: 0}
        for chunk in self.chunks:
            if chunk.is_gathered:
                mem[self.compute_device.type] += chunk.chunk_mem
            if not chunk.keep_gathered:
                mem[chunk.device_type] = mem.get(chunk.device_type, 0) + chunk.shard_mem
        return mem

    def move_chunk(self, chunk: Chunk, device: torch.device | str) -> None:
        """Keep ``chunk``'s working shard on ``device`` from now on (moved now if present).

        Raises:
            RuntimeError: the chunk is in use or kept gathered.
        """
        device = torch.device(device)
        if device.type == chunk.device_type:
            return
        if not chunk.can_move or chunk.keep_gathered:
            raise RuntimeError(
                f"chunk {chunk.chunk_id} cannot move now (in use: {not chunk.can_move}, kept "
                f"gathered: {chunk.keep_gathered}); the placement policy must skip it."
            )
        chunk.device_type = device.type
        if chunk.shard is not None:
            with model_data_scope():
                chunk.shard = chunk.pinned(chunk.shard.to(chunk.shard_device))

    # ------------------------------------------------------------------ gather / release
    @property
    def gathers(self) -> int:
        """All-gathers issued so far (every chunk)."""
        return sum(c.gathers for c in self.chunks)

    def gather(self, chunk: Chunk, async_op: bool = False) -> None:
        """Gather ``chunk`` (COLLECTIVE) unless it is already; remember it as accessed."""
        if chunk.is_gathered:
            if not async_op:
                chunk.wait()
            return
        chunk.gather(async_op=async_op)
        self.prefetches += int(async_op)
        self.accessed_chunks.append(chunk)

    def release(self, chunk: Chunk) -> None:
        """Release ``chunk`` if it may be released (not kept gathered, not in use)."""
        if chunk.can_release and not chunk.gather_pending:
            chunk.release()
            self.accessed_chunks.remove(chunk)

    def release_all(self) -> None:
        """Release every releasable chunk (end of forward and of backward)."""
        for chunk in list(self.accessed_chunks):
            self.release(chunk)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
