"""Fill Gemini's chunks from a lazily built model: each rank computes the model's values once, in
construction order, and keeps only its shard of each chunk — the full model never exists in one
process (``kolossos.lazy``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kolossos.lazy import replay_tensors, swap_in
from kolossos.zero.gemini.chunk import ChunkManager

__all__ = ["fill_chunks_lazily"]


def fill_chunks_lazily(
    manager: ChunkManager,
    lazy: list[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Initialise every chunk of ``manager`` from the lazy tensors ``lazy`` (COLLECTIVE over
    ``group``: every rank replays with its rank 0's random states, so the values equal an eager
    model broadcast from rank 0). Lazy tensors outside the chunks (buffers) are materialised
    whole on ``device``; chunked parameters become empty placeholders the chunks fill on use."""
    parts = {  # a sharded chunk's part is its fp32 master: allocated where the policy put it
        chunk.chunk_id: torch.zeros(
            chunk.chunk_size if chunk.keep_gathered else chunk.shard_size,
            dtype=torch.float32,
            device=device if chunk.keep_gathered else chunk.optim_device,
        )
        for chunk in manager
    }
    whole: dict[int, torch.Tensor] = {}

    def receive(index: int, full: torch.Tensor) -> None:
        tensor = lazy[index][1]
        if not manager.manages(tensor):
            whole[index] = full.to(device, copy=True)
            return
        chunk, info = manager.locate(tensor)
        flat, part = full.reshape(-1), parts[chunk.chunk_id]
        lo, hi = info.offset, info.offset + info.numel
        if chunk.keep_gathered:
            part[lo:hi].copy_(flat)
            return
        begin, end = max(lo, chunk.shard_begin), min(hi, chunk.shard_begin + chunk.shard_size)
        if begin < end:
            part[begin - chunk.shard_begin : end - chunk.shard_begin].copy_(
                flat[begin - lo : end - lo]
            )

    src = dist.get_global_rank(group, 0) if dist.is_initialized() and group is not None else 0
    replay_tensors([t for _, t in lazy], receive, group, src)
    for index, (_, tensor) in enumerate(lazy):
        placeholder = torch.empty(0, dtype=tensor.dtype, device=device)
        swap_in(tensor, whole.get(index, placeholder))
    for chunk in manager:
        part = parts.pop(chunk.chunk_id)
        if chunk.keep_gathered:
            chunk.initialise(part)
        else:
            chunk.initialise_shard(part)
