"""One flat gradient all-reduce at the end of each backward, as DDP's buckets do, for the
auto-parallel executors (:mod:`~kolossos.auto_parallel.apply_transformer`'s data parallel
families, :mod:`~kolossos.auto_parallel.apply_graph`'s whole parameters used by sharded
operators)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

__all__ = ["reduce_gradients_after_backward"]


def reduce_gradients_after_backward(
    params: Sequence[nn.Parameter], group: dist.ProcessGroup, *, average: bool
) -> None:
    """After each backward, all-reduce ``params``' gradients over ``group`` in one flat buffer
    (copied in, reduced, copied back): summed, or ``average``-d over the group's ranks. A
    parameter this rank did not use takes part with a zero gradient (an autograd-engine
    callback queued by the first gradient to arrive)."""
    size = dist.get_world_size(group)
    queued = [False]

    def finish() -> None:
        queued[0] = False
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def hook(_: torch.Tensor) -> None:
        if not queued[0]:
            queued[0] = True
            Variable._execution_engine.queue_callback(finish)

    for param in params:
        param.register_post_accumulate_grad_hook(hook)
