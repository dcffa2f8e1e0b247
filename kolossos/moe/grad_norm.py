"""The global gradient norm of a model with expert-parallel layers, for gradient clipping.

Each rank of an expert-parallel group holds other experts, so the model's norm adds up the
experts' ``|g|^p`` over that group; ordinary parameters (and experts held whole by every rank)
are replicated and enter once. Without this, each rank would clip by its own norm and the
replicated parameters would drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.moe.params import moe_info_of

__all__ = ["ExpertParallelGradNorm", "expert_parallel_grad_norm"]


def _local(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for the inf-norm) of ``grads``, in fp32."""
    if not grads:
        return torch.zeros((), device=device)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().float() for g in grads]).max().to(device)
    pieces = [g.detach().float().norm(norm_type).pow(norm_type) for g in grads]
    return torch.stack(pieces).sum().to(device)


class ExpertParallelGradNorm:
    """A :class:`~kolossos.interface.protocols.GradNormFn` over the expert-parallel groups.

    Example:
        >>> optimizer.grad_norm_fn = expert_parallel_grad_norm(model)  # doctest: +SKIP
    """

    def __call__(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], norm_type: float
    ) -> torch.Tensor:
        """The whole model's ``norm_type``-norm (COLLECTIVE over each expert-parallel group, in
        the order of first appearance, the same on every rank)."""
        device = pairs[0][0].device if pairs else torch.device("cpu")
        dense: list[torch.Tensor] = []
        split: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
        for grad, param in pairs:
            info = moe_info_of(param)
            if info is None or info.ep_group is None:
                dense.append(grad)
            else:
                split.setdefault(id(info.ep_group), (info.ep_group, []))[1].append(grad)
        total = _local(dense, norm_type, device)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        for group, grads in split.values():
            part = _local(grads, norm_type, device)
            dist.all_reduce(part, op=op, group=group)  # SYNC POINT
            total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
        return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def expert_parallel_grad_norm(model: nn.Module) -> ExpertParallelGradNorm | None:
    """The norm function for ``model`` when it has experts spread over ranks, else ``None``."""
    spread = any(
        info is not None and info.ep_group is not None
        for info in map(moe_info_of, model.parameters())
    )
    return ExpertParallelGradNorm() if spread else None
