"""Overflow detection for loss-scaled gradients: find inf/NaN, unscale in place, agree across ranks.

The local checks return 0-dim float32 tensors (1.0 = overflow, 0.0 = none) that stay on the
gradients' device, so checking many tensors costs no host synchronisation; the single sync happens
in :func:`all_reduce_overflow`, where every rank needs the same Python answer anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist

from kolossos.cluster.collectives import comm_device

__all__ = ["all_reduce_overflow", "has_inf_or_nan", "unscale_and_check_"]


def _values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of ``t`` (the non-zeros of a sparse COO tensor)."""
    return t.coalesce().values() if t.is_sparse else t


def _combine(flags: list[torch.Tensor]) -> torch.Tensor:
    """OR together 0-dim flags, possibly on several devices, into one float32 flag."""
    if not flags:
        return torch.zeros((), dtype=torch.float32)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for flag in flags:
        by_device.setdefault(flag.device, []).append(flag)
    # Prefer an accelerator as the home of the result: the later all-reduce wants it there.
    home = next((d for d in by_device if d.type != "cpu"), next(iter(by_device)))
    partial = [torch.stack(group).any().to(home) for group in by_device.values()]
    return torch.stack(partial).any().to(torch.float32)


def has_inf_or_nan(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Whether any tensor holds an inf, -inf or NaN, without a host sync per tensor.

    Large finite values (e.g. 65504 in fp16) are not an overflow: the test is element-wise
    ``isfinite``, never a sum or a norm that could itself overflow. ``None`` entries (parameters
    without a gradient), empty and integer tensors are skipped.

    Args:
        tensors: gradients or any other tensors; they may live on different devices.

    Returns:
        A 0-dim float32 tensor, 1.0 if a non-finite value was found and 0.0 otherwise, on the first
        accelerator device among the inputs (CPU if none).

    Example:
        >>> has_inf_or_nan([torch.ones(3), torch.tensor([1.0, float("nan")])])
        tensor(1.)
    """
    flags: list[torch.Tensor] = []
    for t in tensors:
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        values = _values(t)
        if values.numel() > 0:
            flags.append(torch.isfinite(values).all().logical_not())
    return _combine(flags)


@functools.cache
def _fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused check-and-unscale kernel runs for this device and dtype (cached)."""
    probe = [torch.ones(2, dtype=dtype, device=device)]
    found = torch.zeros((), dtype=torch.float32, device=device)
    inv = torch.ones((), dtype=torch.float32, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(probe, found, inv)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def unscale_and_check_(
    grads: Iterable[torch.Tensor | None],
    inv_scale: float | torch.Tensor,
    *,
    fused: bool | None = None,
) -> torch.Tensor:
    """Multiply gradients by ``inv_scale`` in place and report whether any was non-finite.

    Dense gradients go through ``torch._amp_foreach_non_finite_check_and_unscale_`` (one fused
    kernel per device and dtype) where that kernel exists for the device; otherwise, and for
    sparse gradients, a check with :func:`has_inf_or_nan` followed by an in-place multiply is used.
    Both paths leave the same values and the same flag. The check looks at the values *before*
    the multiply, so an overflow is never hidden (or created) by unscaling.

    Args:
        grads: the scaled gradients, modified in place; ``None`` entries are skipped.
        inv_scale: ``1 / loss_scale``, a float or a 0-dim/1-element tensor.
        fused: ``True`` or ``False`` forces the path (``True`` still falls back where the kernel
            is missing); ``None`` (default) picks the fused kernel where it works.

    Returns:
        The local overflow flag: a 0-dim float32 tensor, 1.0 if a non-finite value was found.
        Reduce it across ranks with :func:`all_reduce_overflow`.

    Example:
        >>> g = [torch.tensor([2.0, 4.0])]
        >>> unscale_and_check_(g, 0.5), g[0]
        (tensor(0.), tensor([1., 2.]))
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    sparse: list[torch.Tensor] = []
    for g in grads:
        if g is None:
            continue
        if g.is_sparse:
            sparse.append(g)
        else:
            groups.setdefault((g.device, g.dtype), []).append(g)
    flags: list[torch.Tensor] = []
    with torch.no_grad():
        for (device, dtype), group in groups.items():
            if fused is not False and _fused_supported(device, dtype):
                found = torch.zeros((), dtype=torch.float32, device=device)
                inv = torch.as_tensor(inv_scale, dtype=torch.float32, device=device).reshape(())
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
                flags.append(found > 0)
            else:
                flags.append(has_inf_or_nan(group).to(device) > 0)
                torch._foreach_mul_(group, _scalar_on(inv_scale, device))
        for g in sparse:
            flags.append(has_inf_or_nan([g]).to(g.device) > 0)
            g.mul_(_scalar_on(inv_scale, g.device))
    return _combine(flags)


def _scalar_on(value: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(())
    return float(value)


def all_reduce_overflow(flag: torch.Tensor | bool, group: dist.ProcessGroup | None = None) -> bool:
    """Make every rank agree on overflow: True if any rank of ``group`` saw one.

    A MAX all-reduce over ``group`` when torch.distributed is initialized (and the group has
    more than one rank); otherwise the local flag is returned. ``flag`` itself is not modified.
    This is a collective (every rank of ``group`` must call it) and a host sync point.

    Args:
        flag: a local flag from :func:`has_inf_or_nan` / :func:`unscale_and_check_` (any
            0-dim or 1-element numeric/bool tensor, nonzero meaning overflow), or a bool.
        group: the process group to agree over; ``None`` is the default (world) group.

    Returns:
        The global overflow decision as a Python bool.

    Example:
        >>> all_reduce_overflow(torch.tensor(0.0))  # no process group: the local answer
        False
    """
    local = torch.as_tensor(flag).detach().reshape(()).to(torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # NCCL cannot reduce host tensors: a CPU flag travels through the accelerator
        home = local.device if local.device.type != "cpu" else comm_device(group)
        local = local.to(home, copy=True)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return bool(local.item() > 0)  # host sync
