"""Moving a chunk's optimizer data (fp32 master, gradient shard, optimizer states) between host
and device: what ``gpu_margin_mem_ratio`` does under the ``auto`` placement policy.

Before each step the optimizer offers the policy the chunks whose optimizer data is on the host;
the policy grants those that fit in ``gpu_margin_mem_ratio`` of the device memory the warm-up
iteration found spare, and their data moves to the compute device for good (Colossal-AI's
behaviour). The first offer comes before the first step, so the states of a granted chunk are
created on the device and never exist on the host: their size is predicted for the Adam family
(:func:`optim_data_bytes`); a chunk whose states cannot be predicted is offered once they exist.
NVMe-streamed states are never moved (they belong to the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.nn.optimizer._adam_base import AdamBase
from kolossos.zero.gemini.chunk import Chunk

__all__ = ["host_optim_chunks", "move_optim_data", "optim_data_bytes"]


def _streamed(optim: Optimizer, view: nn.Parameter) -> bool:
    return isinstance(optim, AdamBase) and optim.is_streamed(view)


def _state_bytes(optim: Optimizer, view: nn.Parameter, group: dict[str, Any]) -> int | None:
    """Bytes of ``view``'s optimizer states: those it has, else the ones its first step will
    create for kolossos' Adams and ``torch.optim.Adam``/``AdamW`` (the moments and the fp32
    step counter); ``None`` for another optimizer whose states do not exist yet."""
    state = optim.state.get(view)
    if state:
        return sum(
            v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
        )
    if isinstance(optim, AdamBase):
        count, dtype = len(optim.state_names(group)), optim.state_dtype(view)
    elif isinstance(optim, (torch.optim.Adam, torch.optim.AdamW)):
        count, dtype = (3 if group.get("amsgrad") else 2), view.dtype
    else:
        return None
    return count * view.numel() * dtype.itemsize + 4


def optim_data_bytes(optim: Optimizer, chunk: Chunk, views: Sequence[nn.Parameter]) -> int | None:
    """Bytes of ``chunk``'s fp32 master and gradient shard plus its views' optimizer states
    (predicted before the first step, see :func:`_state_bytes`; ``None`` when unpredictable)."""
    groups = {id(p): g for g in optim.param_groups for p in g["params"]}
    # fp32 master + the gradient shard as one backward leaves it (``grad_dtype``): the auto
    # policy reserves a bf16 shard's widening only while gradients accumulate
    total = (4 + chunk.grad_dtype.itemsize) * chunk.shard_size
    for view in views:
        nbytes = _state_bytes(optim, view, groups[id(view)])
        if nbytes is None:
            return None
        total += nbytes
    return total


def host_optim_chunks(
    optim: Optimizer, chunks: Sequence[Chunk], views: dict[int, list[nn.Parameter]]
) -> list[tuple[Chunk, int]]:
    """``(chunk, optimizer bytes)`` of the chunks whose optimizer data is on the host and may
    move (no NVMe-streamed state, a known size), in chunk order."""
    offer = []
    for chunk in chunks:
        own = views.get(chunk.chunk_id, [])
        if not chunk.optim_on_host or any(_streamed(optim, v) for v in own):
            continue
        nbytes = optim_data_bytes(optim, chunk, own)
        if nbytes is not None:
            offer.append((chunk, nbytes))
    return offer


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
