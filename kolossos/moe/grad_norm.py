"""The global gradient norm of a model with expert-parallel layers, for gradient clipping.

Each rank of an expert-parallel group holds other experts, so the model's norm adds up the
experts' ``|g|^p`` over that group; ordinary parameters (and experts held whole by every rank)
are replicated and enter once. Without this, each rank would clip by its own norm and the
replicated parameters would drift apart.

:func:`moe_hybrid_norm` is the same rule for the MoE hybrid engine, where gradients may also be
ZeRO partitions (the dense ones over the data-parallel group, the experts over their expert
data-parallel group) and pipeline stages hold different layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.moe.params import moe_info_of

__all__ = [
    "ExpertParallelGradNorm",
    "clip_grads_to_norm_",
    "expert_parallel_grad_norm",
    "moe_hybrid_norm",
    "norm_type_of",
]


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


def _reduce(value: torch.Tensor, op: Any, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)  # SYNC POINT


def moe_hybrid_norm(
    dense: Sequence[torch.Tensor],
    experts: Sequence[torch.Tensor],
    norm_type: float,
    *,
    ep_group: dist.ProcessGroup | None,
    dense_partition_group: dist.ProcessGroup | None = None,
    expert_partition_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The whole model's ``norm_type``-norm from this rank's dense and expert gradients.

    COLLECTIVE, in this order: the dense part over ``dense_partition_group`` (ZeRO partitions
    of the dense gradients; ``None``: every data-parallel rank holds them all), the expert part
    over ``expert_partition_group`` (their ZeRO partitions) then over ``ep_group`` (each EP
    rank holds other experts, so every expert is counted once), and the stage totals over
    ``pp_group``. Pass each parameter tied across stages from one stage only.

    Returns:
        A 0-dim fp32 tensor, the same on every rank.

    Example:
        >>> moe_hybrid_norm([torch.tensor([3.0])], [torch.tensor([4.0])], 2.0, ep_group=None)
        tensor(5.)
    """
    device = device or torch.device("cpu")
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    dense_part = _local(list(dense), norm_type, device).reshape(1)
    expert_part = _local(list(experts), norm_type, device).reshape(1)
    _reduce(dense_part, op, dense_partition_group)
    _reduce(expert_part, op, expert_partition_group)
    _reduce(expert_part, op, ep_group)
    total = torch.maximum(dense_part, expert_part) if inf else dense_part + expert_part
    _reduce(total, op, pp_group)
    return total[0] if inf else total[0].pow(1.0 / norm_type)


def norm_type_of(norm_type: object) -> float:
    """``norm_type`` as a float (a number > 0, or ``inf``).

    Raises:
        TypeError / ValueError: anything else.
    """
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type={norm_type!r} must be a number (2.0, 1.0, float('inf')).")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type={norm_type!r} must be > 0 (e.g. 2.0) or float('inf').")
    return float(norm_type)


def clip_grads_to_norm_(
    grads: Sequence[torch.Tensor | None],
    max_norm: float,
    total: torch.Tensor,
    error_if_nonfinite: bool = False,
) -> None:
    """Scale ``grads`` in place so a total norm of ``total`` becomes at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``'s factor ``max_norm / (total + 1e-6)``, capped at 1).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and ``total`` is inf or NaN.
    """
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total gradient norm is {float(total)}; set error_if_nonfinite=False to clip "
            "anyway."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        if g is not None:
            g.mul_(coef.to(g.device))
