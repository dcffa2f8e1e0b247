"""Gradient norms and clipping over partitioned gradients.

Each rank holds one partition of every gradient; the global norm is one all-reduce of the
partial results: the sum of ``|g|^p`` (or the maximum of ``|g|`` for ``p = inf``) over each
rank's partitions, padding excluded. Every rank then scales its own partitions by the same
factor, ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

#: elements per piece of :func:`power_sum` on the CPU (1 MiB in fp32, as the Adam update's
#: pieces there: cache-sized)
NORM_PIECE_NUMEL = 1 << 18
#: elements per piece on an accelerator (64 MiB in fp32, as the Adam update's pieces there): few
#: kernel launches, where CPU-sized pieces would cost four thousand for a billion elements
ACCELERATOR_NORM_PIECE_NUMEL = 1 << 24

__all__ = [
    "ACCELERATOR_NORM_PIECE_NUMEL",
    "NORM_PIECE_NUMEL",
    "check_finite_norm",
    "clip_by_total_norm_",
    "clip_coefficient",
    "global_norm",
    "norm_piece_numel",
    "power_sum",
]


def global_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """The ``norm_type``-norm of all ranks' ``grads`` together (a collective: one all-reduce).

    Args:
        grads: this rank's gradient pieces (padding already cut off).
        norm_type: ``p`` > 0, or ``inf``.
        group: the ranks sharing the gradients.
        device: where the all-reduced scalar lives (the CPU for gloo).

    Returns:
        A 0-dim fp32 tensor on ``device``.
    """
    valid = [g for g in grads if g.numel()]
    if math.isinf(norm_type):
        maxima = [g.abs().max().float().to(device) for g in valid]
        total = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    powers = [power_sum(g, norm_type).to(device) for g in valid]
    total = torch.stack(powers).sum() if powers else torch.zeros((), device=device)
    dist.all_reduce(total, group=group)
    return total ** (1.0 / norm_type)


def norm_piece_numel(device: torch.device) -> int:
    """Elements per piece of :func:`power_sum` on ``device``: :data:`NORM_PIECE_NUMEL` on the
    CPU, :data:`ACCELERATOR_NORM_PIECE_NUMEL` elsewhere."""
    return NORM_PIECE_NUMEL if device.type == "cpu" else ACCELERATOR_NORM_PIECE_NUMEL


def power_sum(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum(|grad| ** norm_type)`` (finite ``norm_type``) in fp32, over pieces of
    :func:`norm_piece_numel` elements widened to fp32 one at a time: a bf16 gradient and its fp32
    copy give the same bits, a bf16 one needs no fp32 copy (and avoids the CPU's slow
    mixed-dtype norm), and a large tensor sums more accurately than in one reduction."""
    flat = grad.reshape(-1)
    step = norm_piece_numel(grad.device)
    parts = [
        torch.linalg.vector_norm(flat[a : a + step].float(), norm_type) ** norm_type
        for a in range(0, flat.numel(), step)
    ]
    return torch.stack(parts).sum() if parts else torch.zeros((), device=grad.device)


def clip_by_total_norm_(
    grads: Sequence[torch.Tensor | None], max_norm: float, total: torch.Tensor
) -> None:
    """Scale ``grads`` in place so that a total norm of ``total`` becomes at most ``max_norm``."""
    coef = clip_coefficient(max_norm, total)
    for g in grads:
        if g is not None:
            g.mul_(coef.to(g.device))


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """The factor that scales gradients of total norm ``total`` to at most ``max_norm``."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def check_finite_norm(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
    """Raise for a non-finite total norm when asked to (``clip_grad_norm_``'s contract).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and ``total`` is inf or NaN.
    """
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite; set "
            "error_if_nonfinite=False to clip anyway."
        )
