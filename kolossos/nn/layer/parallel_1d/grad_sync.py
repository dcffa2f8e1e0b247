"""Gradient sums for replicated parameters used on sequence shards (Megatron sequence
parallelism): LayerNorm weights and row-parallel biases see only their rank's part of the
sequence, so their gradients are summed over the tensor-parallel group before the step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d.sharding import is_sequence_parallel

__all__ = ["all_reduce_sequence_parallel_grads", "sequence_parallel_params"]


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` marked by
    :func:`~kolossos.nn.layer.parallel_1d.sharding.mark_sequence_parallel`, each once."""
    seen: set[int] = set()
    found: list[nn.Parameter] = []
    for param in module.parameters():
        if is_sequence_parallel(param) and id(param) not in seen:
            seen.add(id(param))
            found.append(param)
    return found


def all_reduce_sequence_parallel_grads(module: nn.Module, process_group: ProcessGroup) -> int:
    """Sum the gradients of ``module``'s sequence-parallel parameters over ``process_group``
    (one flat all-reduce per dtype). COLLECTIVE: call after backward, before the optimizer step,
    on every rank of the group.

    Returns:
        The number of gradients reduced.
    """
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if not grads or dist.get_world_size(process_group) == 1:
        return len(grads)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group_grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group_grads])
        dist.all_reduce(flat, group=process_group)  # SYNC POINT
        offset = 0
        for grad in group_grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return len(grads)
