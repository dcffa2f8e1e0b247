"""Small collective helpers shared by the engines: where a group's tensors must live, and one
flat all-reduce for many tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from kolossos.accelerator import get_accelerator

__all__ = ["all_reduce_coalesced", "comm_device"]


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors must live to take part in ``group``'s collectives: the CPU for gloo (and
    without a process group), the accelerator's current device otherwise (NCCL).

    Example:
        >>> comm_device(None)  # no process group initialised
        device(type='cpu')
    """
    if not dist.is_initialized() or "gloo" in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return get_accelerator().get_current_device()


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> None:
    """Sum ``tensors`` in place over ``group``: one flat all-reduce per dtype (a collective;
    every rank of the group passes tensors of the same shapes in the same order).

    Args:
        tensors: the tensors to sum (any devices).
        group: the process group.
        device: where the flat buffer is reduced (default: :func:`comm_device` of ``group``).

    Example:
        >>> all_reduce_coalesced([torch.ones(2)], None)  # doctest: +SKIP
    """
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    home = device if device is not None else comm_device(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1).to(home) for t in same])
        dist.all_reduce(flat, group=group)  # SYNC POINT
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
