"""Gradients of sequence-parallel parameters: summed over the tensor-parallel group.

Under Megatron sequence parallelism the layer norms (and the row-parallel biases) run on each
rank's slice of the sequence, so each rank's gradient of these replicated parameters covers only
its tokens; the full gradient is their sum over the TP group. The optimizers sum them once per
step, right before the gradients are unscaled, checked and clipped, in one all-reduce per dtype.
Summing after the data-parallel reduction (DDP, ZeRO) and after gradient accumulation is exact:
every step in between is a sum too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_reduce_coalesced"]


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
        device: where the flat buffer is reduced (e.g. the GPU for NCCL when the tensors were
            offloaded to the CPU); default: the first tensor's device.

    Example:
        >>> all_reduce_coalesced([torch.ones(2)], None)  # doctest: +SKIP
    """
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1).to(device or same[0].device) for t in same])
        dist.all_reduce(flat, group=group)  # SYNC POINT: the TP group
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
