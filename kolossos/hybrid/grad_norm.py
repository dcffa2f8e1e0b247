"""The global gradient norm of a tensor-parallel model, and clipping by it.

Under tensor parallelism a parameter is either *sharded* (it carries a
:class:`~kolossos.nn.layer.parallel_1d.sharding.TPShardSpec`: each TP rank holds a different
piece) or *replicated* (every TP rank holds the same tensor and, after the sequence-parallel
all-reduce, the same gradient). The norm of the full model counts every element once:

    ``||g||_p^p = sum over TP ranks of sum_sharded |g|^p  +  sum_replicated |g|^p``

so the sharded part is all-reduced over the TP group and the replicated part is taken as is.
With ZeRO, gradients are further partitioned over the data-parallel group, so both parts are
first summed over it. With pipeline parallelism each stage holds different layers, so the
stages' totals are summed over the pipeline group last; a parameter tied across stages (one copy
per stage) is passed by one stage only. Padding rows of vocabulary-parallel tensors need no
special care: they are never looked up and their logits never enter the loss, so their
gradients are exactly zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from kolossos.zero.low_level.clip import power_sum

__all__ = ["tp_global_norm"]


def _partials(
    pieces: Iterable[tuple[torch.Tensor, bool]], norm_type: float, device: torch.device
) -> torch.Tensor:
    """``[sharded part, replicated part]`` of this rank's pieces: sums of ``|g|^p`` (or maxima
    of ``|g|`` for ``p = inf``), in fp32 on ``device``."""
    out = torch.zeros(2, dtype=torch.float32, device=device)
    for grad, sharded in pieces:
        if grad.numel() == 0:
            continue
        slot = 0 if sharded else 1
        if math.isinf(norm_type):
            value = grad.detach().abs().max().float().to(device)
            out[slot] = torch.maximum(out[slot], value)
        else:
            out[slot] += power_sum(grad.detach(), norm_type).to(device)
    return out


def tp_global_norm(
    pieces: Iterable[tuple[torch.Tensor, bool]],
    norm_type: float,
    tp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's gradients (a collective).

    Args:
        pieces: ``(gradient or a piece of it, is_tp_sharded)`` for this rank's gradients.
        norm_type: ``p`` > 0, or ``inf``.
        tp_group: the tensor-parallel group (``None`` or a 1-rank group: no TP).
        dp_group: the data-parallel group when the pieces are ZeRO partitions (each dp rank
            holds different pieces), else ``None`` (DDP: every dp rank holds all of them).
        device: where the scalars are reduced (the CPU for gloo; default CPU).
        pp_group: the pipeline group when the pieces are one stage's layers (each stage passes
            its own parameters, tied copies once), else ``None``.

    Returns:
        A 0-dim fp32 tensor on ``device``, the same on every rank.

    Example:
        >>> g = torch.tensor([3.0, 4.0])
        >>> tp_global_norm([(g, False)], 2.0, None)  # no process group: the local norm
        tensor(5.)
    """
    device = device or torch.device("cpu")
    parts = _partials(pieces, norm_type, device)
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(parts, op=op, group=dp_group)  # SYNC POINT: ZeRO partitions
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        sharded = parts[:1].clone()
        dist.all_reduce(sharded, op=op, group=tp_group)  # SYNC POINT: the TP shards
        parts[0] = sharded[0]
    total = parts.max() if inf else parts.sum()
    if pp_group is not None and dist.is_initialized() and dist.get_world_size(pp_group) > 1:
        total = total.reshape(1)
        dist.all_reduce(total, op=op, group=pp_group)  # SYNC POINT: the pipeline stages
        total = total[0]
    return total if inf else total ** (1.0 / norm_type)
