"""Moving a chunk's optimizer data (fp32 master, gradient shard, optimizer states) between host
and device: what ``gpu_margin_mem_ratio`` does under the ``auto`` placement policy.

After each step the optimizer offers the policy the chunks whose optimizer data is on the host;
the policy grants those that fit in ``gpu_margin_mem_ratio`` of the device memory the warm-up
iteration found spare, and their data moves to the compute device for good (Colossal-AI's
behaviour). NVMe-streamed states are never moved (they belong to the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.nn.optimizer._adam_base import AdamBase
from kolossos.zero.gemini.chunk import Chunk

__all__ = ["host_optim_chunks", "move_optim_data", "optim_data_bytes"]


def _streamed(optim: Optimizer, view: nn.Parameter) -> bool:
    return isinstance(optim, AdamBase) and optim.is_streamed(view)


def optim_data_bytes(optim: Optimizer, chunk: Chunk, views: Sequence[nn.Parameter]) -> int:
    """Bytes of ``chunk``'s fp32 master and gradient shard plus its views' optimizer states."""
    total = 8 * chunk.shard_size  # fp32 master + fp32 gradient shard
    for view in views:
        for value in optim.state.get(view, {}).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def host_optim_chunks(
    optim: Optimizer, chunks: Sequence[Chunk], views: dict[int, list[nn.Parameter]]
) -> list[tuple[Chunk, int]]:
    """``(chunk, optimizer bytes)`` of the chunks whose optimizer data is on the host and may
    move (no NVMe-streamed state), in chunk order."""
    return [
        (chunk, optim_data_bytes(optim, chunk, views.get(chunk.chunk_id, [])))
        for chunk in chunks
        if chunk.optim_on_host
        and not any(_streamed(optim, v) for v in views.get(chunk.chunk_id, []))
    ]


def move_optim_data(
    optim: Optimizer,
    chunk: Chunk,
    views: Sequence[tuple[int, int, nn.Parameter]],
    device: torch.device,
) -> None:
    """Move ``chunk``'s master, gradient shard and its views' states to ``device``.

    ``views`` are ``(begin, end, master view)`` of the chunk's slices in the optimizer. 0-dim
    states (``step``) follow only for kolossos' Adams, which keep them beside the parameter;
    ``torch.optim`` expects them on the host.
    """
    assert chunk.master is not None
    old = chunk.master.device
    chunk.master = chunk.master.to(device)
    if chunk.grad_shard is not None:
        chunk.grad_shard = chunk.grad_shard.to(device)
    for begin, end, view in views:
        view.data = chunk.master[begin:end]
        state = optim.state.get(view, {})
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.device != old:
                continue
            if value.dim() > 0 or isinstance(optim, AdamBase):
                state[key] = value.to(device)
    chunk.optim_device = device
    chunk.optim_on_host = False
