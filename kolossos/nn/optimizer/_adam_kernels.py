"""Adam/AdamW update kernels shared by :class:`CPUAdam`, :class:`HybridAdam` and :class:`FusedAdam`.

One entry point, :func:`adam_update`, updates lists of tensors in place and picks the fastest
implementation that needs no compiler on the user's machine:

- **fused**: PyTorch's own single-pass kernels (``torch._fused_adamw_`` / ``torch._fused_adam_``),
  vectorised and multi-threaded (``torch.get_num_threads()``) on the CPU and fused on CUDA. Every
  element is read and written once, so the update runs at memory bandwidth.
- **mixed**: low-precision parameters or gradients (bf16/fp16) with fp32 states, the layout
  CPUAdam/HybridAdam keep. The tensors are walked in pieces: a piece of the parameter and gradient
  is widened into fp32 scratch buffers, updated by the fused kernel together with the matching
  slices of the states, and rounded back. On the CPU a piece is cache-sized (``CHUNK_NUMEL``), on
  an accelerator 16 Mi elements (a few launches for the largest tensors). Nothing
  parameter-sized is allocated (a non-contiguous tensor is widened whole).
- **foreach**: a plain ``torch._foreach_*`` implementation, the automatic fallback wherever the
  fused kernel is missing (older torch, other devices or dtypes).

The caller increments the ``step`` tensors before calling. All paths compute the same update as
``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam`` (L2 weight decay).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CHUNK_NUMEL", "AdamHyper", "adam_update", "fused_supported"]

#: elements per chunk of the mixed-precision CPU path: 1 MiB fp32 scratch per operand, so one
#: chunk of parameter, gradient and both states stays in the L2/L3 cache. A power of two, so chunk
#: boundaries fall on the same elements as the NVMe offloader's unit boundaries (bitwise-identical
#: results whether states are resident or streamed).
CHUNK_NUMEL = 1 << 18
#: elements per piece of the mixed-precision path on an accelerator (64 MiB of fp32 scratch)
ACCELERATOR_PIECE_NUMEL = 1 << 24

_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})
_FUSED_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
#: set KOLOSSOS_ADAM_IMPL=foreach to force the fallback (debugging, comparisons)
IMPL_ENV = "KOLOSSOS_ADAM_IMPL"


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one Adam update (one parameter group)."""

    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    """True: decoupled weight decay (AdamW); False: L2 penalty added to the gradient (Adam)"""
    bias_correction: bool = True
    amsgrad: bool = False


def fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether PyTorch's fused Adam kernel can update tensors of this device and dtype here."""
    if os.environ.get(IMPL_ENV, "auto") == "foreach":
        return False
    if not hasattr(torch, "_fused_adamw_") or device.type not in _FUSED_DEVICES:
        return False
    return dtype in _FUSED_DTYPES and not (device.type == "mps" and dtype == torch.float64)


def adam_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor] | None,
    steps: list[Tensor],
    hp: AdamHyper,
    narrow_grad_scale: Tensor | None = None,
) -> None:
    """Apply one Adam/AdamW update in place to every tensor of the lists.

    Lists are parallel (same length; matching shapes). States may be wider than the parameter
    (fp32 states for bf16 parameters). ``steps`` hold the step number to use, already incremented.
    ``narrow_grad_scale`` multiplies the gradients of the mixed path once they are widened (a
    clipping factor that a caller keeping bf16 gradients defers to here, where it costs no copy
    and rounds as it would on fp32 gradients); the other paths' gradients are used as they are.

    Example:
        >>> p, g = torch.ones(4), torch.full((4,), 0.5)
        >>> m, v, s = torch.zeros(4), torch.zeros(4), torch.ones(())
        >>> hp = AdamHyper(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        ...                adamw_mode=True)
        >>> adam_update([p], [g], [m], [v], None, [s], hp)
        >>> round(p[0].item(), 4)
        0.9
    """
    if hp.amsgrad and max_exp_avg_sqs is None:
        raise ValueError("amsgrad=True needs max_exp_avg_sqs")
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs, strict=True)):
        uniform = p.dtype == g.dtype == m.dtype
        groups.setdefault((p.device, m.dtype, uniform), []).append(i)
    for (device, dtype, uniform), idx in groups.items():
        maxes = max_exp_avg_sqs if hp.amsgrad else None
        p_, g_, m_, v_, mx_, s_ = (
            [seq[i] for i in idx] if seq is not None else []
            for seq in (params, grads, exp_avgs, exp_avg_sqs, maxes, steps)
        )
        if not uniform:
            _mixed(p_, g_, m_, v_, mx_, s_, hp, narrow_grad_scale)
        elif fused_supported(device, dtype):
            _fused(p_, g_, m_, v_, mx_, s_, hp)
        else:
            _foreach(p_, g_, m_, v_, mx_, s_, hp)


_NO_BIAS_CORRECTION: dict[torch.device, Tensor] = {}


def _kernel_steps(steps: list[Tensor], hp: AdamHyper) -> list[Tensor]:
    """The steps the fused kernel sees. It always applies bias correction ``1 - beta**step``;
    an infinite step makes ``beta**step`` exactly 0, i.e. no correction."""
    if hp.bias_correction:
        return steps
    device = steps[0].device
    inf = _NO_BIAS_CORRECTION.get(device)
    if inf is None:
        inf = _NO_BIAS_CORRECTION[device] = torch.full((), math.inf, device=device)
    return [inf] * len(steps)


def _fused(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    hp: AdamHyper,
) -> None:
    kernel = torch._fused_adamw_ if hp.adamw_mode else torch._fused_adam_
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs if hp.amsgrad else [],
        _kernel_steps(steps, hp),
        lr=hp.lr,
        beta1=hp.beta1,
        beta2=hp.beta2,
        weight_decay=hp.weight_decay,
        eps=hp.eps,
        amsgrad=hp.amsgrad,
        maximize=False,
    )


def _mixed(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    hp: AdamHyper,
    grad_scale: Tensor | None = None,
) -> None:
    """Parameters/gradients narrower than the states: compute in the states' dtype (the widened
    gradients times ``grad_scale``, when given)."""
    dtype = exp_avgs[0].dtype
    update = _fused if fused_supported(exp_avgs[0].device, dtype) else _foreach
    scratch: dict[str, Tensor] = {}  # fp32 pieces of the parameter (when narrower) and gradient
    scale = None if grad_scale is None else grad_scale.to(exp_avgs[0].device, dtype)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        mx = [max_exp_avg_sqs[i]] if hp.amsgrad else []
        if not all(t.is_contiguous() for t in (p, g, m, v, *mx)):  # widen the whole tensor
            wide = p.to(dtype)
            wide_g = g.to(dtype) if scale is None else g.to(dtype) * scale
            update([wide], [wide_g], [m], [v], mx, [steps[i]], hp)
            p.copy_(wide)
            continue
        n = p.numel()
        narrow_p = p.dtype != dtype  # fp32 parameters with bf16 gradients update in place
        piece = CHUNK_NUMEL if p.device.type == "cpu" else ACCELERATOR_PIECE_NUMEL
        size = min(piece, max(t.numel() for t in params))
        for name in ("p", "g") if narrow_p else ("g",):
            if name not in scratch:
                scratch[name] = torch.empty(size, dtype=dtype, device=p.device)
        pf, gf, mf, vf = (t.view(-1) for t in (p, g, m, v))
        xf = [t.view(-1) for t in mx]
        for a in range(0, n, piece):
            b = min(n, a + piece)
            wp = scratch["p"][: b - a] if narrow_p else pf[a:b]
            wg = scratch["g"][: b - a]
            if narrow_p:
                wp.copy_(pf[a:b])
            wg.copy_(gf[a:b])
            if scale is not None:
                wg.mul_(scale)
            update([wp], [wg], [mf[a:b]], [vf[a:b]], [t[a:b] for t in xf], [steps[i]], hp)
            if narrow_p:
                pf[a:b].copy_(wp)


def _foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    hp: AdamHyper,
) -> None:
    """Reference-quality fallback built from ``torch._foreach_*`` ops (same math as the kernel)."""
    if hp.weight_decay != 0:
        if hp.adamw_mode:
            torch._foreach_mul_(params, 1 - _as_float(hp.lr) * hp.weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=hp.weight_decay))
    torch._foreach_lerp_(exp_avgs, grads, 1 - hp.beta1)
    torch._foreach_mul_(exp_avg_sqs, hp.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - hp.beta2)
    second = exp_avg_sqs
    if hp.amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        second = max_exp_avg_sqs
    lr = _as_float(hp.lr)
    for p, m, v, s in zip(params, exp_avgs, second, steps, strict=True):
        step = float(s.item())
        bc1 = 1 - hp.beta1**step if hp.bias_correction else 1.0
        bc2 = 1 - hp.beta2**step if hp.bias_correction else 1.0
        denom = (v.sqrt() / math.sqrt(bc2)).add_(hp.eps)
        p.addcdiv_(m, denom, value=-lr / bc1)


def _as_float(value: float | Tensor) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)
