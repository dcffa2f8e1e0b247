"""Stepping the ZeRO engines' host-resident shards of a plain ``torch.optim.Adam`` / ``AdamW``
with PyTorch's fused kernel.

LowLevelZero and Gemini re-point the user's optimizer at a few large flat shards. When the user
left the implementation to torch (``foreach=None`` and ``fused=None``, the defaults), torch
steps CPU tensors with its single-tensor loop: about ten passes over every element (``mul_``,
``lerp_``, ``sqrt``, ``div``, ``addcdiv_``, ...). Its fused kernel (``torch._fused_adam_`` /
``torch._fused_adamw_``) reads and writes each element once and costs about a tenth of the CPU
time on a 25M-element shard (measured on the 2-core development machine: 12 ms against 126 ms
of CPU for one step). The result differs from the loop's by rounding only (``~1e-10`` after a
few steps on fp32; ``tests/unit/test_fused_step.py``).

:func:`fused_adam_step` switches the kernel on for the duration of one ``step`` call and restores
the group's flags afterwards, so ``state_dict()`` and the user's optimizer keep what the user
gave. Accelerator-resident parameters are left alone (torch's fused kernels there expect their
``step`` counters on the device, which a state loaded for the loop does not have), as are
optimizers of any other class, groups that chose ``foreach`` or ``fused`` themselves, and
``differentiable`` / ``capturable`` groups. ``KOLOSSOS_ADAM_IMPL=foreach`` turns it off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim import Optimizer

from kolossos.nn.optimizer._adam_kernels import fused_supported

__all__ = ["fused_adam_step"]

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def _fusable(group: dict[str, Any]) -> bool:
    if group.get("foreach") is not None or group.get("fused") is not None:
        return False  # the user chose an implementation
    if group.get("differentiable") or group.get("capturable"):
        return False
    params = [p for p in group["params"] if p.grad is not None]
    return bool(params) and all(
        p.device.type == "cpu"
        and fused_supported(p.device, p.dtype)
        and p.grad is not None
        and p.grad.dtype == p.dtype
        and not p.grad.is_sparse
        for p in params
    )


@contextlib.contextmanager
def fused_adam_step(optimizer: Optimizer) -> Iterator[int]:
    """Inside the context, the groups of a ``torch.optim.Adam`` / ``AdamW`` (exactly those
    classes) that left the kernel to torch and hold only host tensors step with torch's fused
    kernel; yields how many groups were switched (module doc).

    Example:
        >>> opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(4))])
        >>> opt.param_groups[0]["params"][0].grad = torch.ones(4)
        >>> with fused_adam_step(opt) as switched:
        ...     opt.step()
        >>> switched, opt.param_groups[0]["fused"]
        (1, None)
    """
    switched: list[dict[str, Any]] = []
    if type(optimizer) in _FUSABLE:
        for group in optimizer.param_groups:
            if _fusable(group):
                group["fused"] = True
                switched.append(group)
    try:
        yield len(switched)
    finally:
        for group in switched:
            group["fused"] = None
