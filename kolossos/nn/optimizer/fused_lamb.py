"""FusedLAMB: apex's and Colossal-AI's LAMB variant (global gradient clipping, L2 or decoupled
weight decay, NVLAMB), without a compiled kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kolossos.nn.optimizer._adam_base import ParamsT, check_hyper
from kolossos.nn.optimizer._common import (
    closure_loss,
    load_groups_then_states,
    to_state_tensor,
    widened,
)
from kolossos.utils.multi_tensor_apply import multi_tensor_applier, multi_tensor_l2norm

__all__ = ["FusedLAMB"]


class FusedLAMB(torch.optim.Optimizer):
    r"""LAMB as apex's ``FusedLAMB`` kernel computes it (Colossal-AI's ``FusedLAMB``).

    Per step, with ``G`` the L2 norm of all gradients of all groups and ``c = G / max_grad_norm``
    if ``G > max_grad_norm`` else 1, each parameter ``x`` with gradient ``g`` at step ``t``:

    .. math::
        \tilde g = g / c \;(+\,\lambda x \text{ if not adam\_w\_mode}),\quad
        m = \beta_1 m + \beta_3 \tilde g,\quad v = \beta_2 v + (1-\beta_2)\tilde g^2,\\
        u = \frac{m / b_1}{\sqrt{v / b_2} + \epsilon} \;(+\,\lambda x \text{ if adam\_w\_mode}),
        \quad x \leftarrow x - \eta\, \rho\, u

    with ``β3 = 1 - β1`` if ``grad_averaging`` else 1, ``b1 = 1 - β1^t``, ``b2 = 1 - β2^t``
    with ``bias_correction`` (else 1), and the trust ratio ``ρ = ‖x‖ / ‖u‖`` if
    ``use_nvlamb`` or ``λ ≠ 0`` (and both norms are non-zero), else 1. With ``λ ≠ 0``,
    ``adam_w_mode`` and no clipping, this is :class:`~kolossos.nn.optimizer.Lamb` whenever
    ``‖x‖ ≤ 10`` (``Lamb`` clamps the weight norm at 10, this does not, as apex).

    The step count ``t`` is kept per group (``param_groups[i]["step"]``), as upstream.
    fp16/bf16 parameters get fp32 states and fp32 arithmetic (upstream: fp16 states, no bf16).

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate ``η``.
        bias_correction: divide the moments by ``1 - β^t``.
        betas: decay rates ``(β1, β2)``.
        eps: ``ε``, added to the denominator.
        weight_decay: ``λ``.
        amsgrad: not supported (``True`` raises, as upstream).
        adam_w_mode: decoupled weight decay (``True``) or L2 added to the gradient (``False``).
        grad_averaging: ``β3 = 1 - β1`` (``True``) or 1.
        set_grad_none: ``zero_grad()`` sets gradients to ``None`` by default (else zeros them).
        max_grad_norm: clip the global gradient norm to this value (> 0).
        use_nvlamb: apply the trust ratio to parameters without weight decay too.

    Raises:
        RuntimeError: ``amsgrad=True``.
        ValueError: invalid ``lr``, ``betas``, ``eps``, ``weight_decay`` or ``max_grad_norm``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError(
                "FusedLAMB does not support the AMSGrad variant; pass amsgrad=False."
            )
        check_hyper(lr, betas, eps, weight_decay)
        if not float(max_grad_norm) > 0.0:
            raise ValueError(
                f"FusedLAMB(max_grad_norm={max_grad_norm!r}) must be > 0; pass a large value "
                "(e.g. float('inf')) to disable clipping."
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Reset the gradients: to ``None`` if ``set_to_none`` (default: ``set_grad_none``)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _clip_divisor(self) -> Tensor:
        """``c``: the global gradient norm over ``max_grad_norm`` when above it, else 1."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        flag = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        norm = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], False)[0][0]
        max_norm = self.defaults["max_grad_norm"]
        return torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss if a closure is given."""
        loss = closure_loss(closure)
        if not any(p.grad is not None for g in self.param_groups for p in g["params"]):
            return loss
        clip = self._clip_divisor()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLAMB does not support sparse gradients")
                self._update(p, group, clip)
        return loss

    def _update(self, p: Tensor, group: dict[str, Any], clip: Tensor) -> None:
        beta1, beta2 = group["betas"]
        wd, t = group["weight_decay"], group["step"]
        state = self.state[p]
        dtype = widened(p.dtype)
        if not state:
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        assert p.grad is not None
        x = p.to(dtype)
        g = p.grad.to(dtype) / clip.to(p.device)
        if wd != 0 and not self.adam_w_mode:
            g.add_(x, alpha=wd)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1 if group["grad_averaging"] else 1.0)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if group["bias_correction"] else (1.0, 1.0)
        u = (m / bc1).div_((v / bc2).sqrt_().add_(group["eps"]))
        if wd != 0 and self.adam_w_mode:
            u.add_(x, alpha=wd)
        if self.use_nvlamb or wd != 0:
            w_norm, u_norm = torch.linalg.vector_norm(x), torch.linalg.vector_norm(u)
            ok = (w_norm > 0) & (u_norm > 0)
            trust = torch.where(ok, w_norm / torch.where(ok, u_norm, 1.0), 1.0)
        else:
            trust = torch.ones((), dtype=dtype, device=p.device)
        x.sub_(u.mul_(trust * group["lr"]))  # x is p itself unless p is low precision
        if x is not p:
            p.copy_(x)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping fp32 states for low-precision parameters."""
        for _, p, entry in load_groups_then_states(self, state_dict):
            if entry is not None:
                dtype = widened(p.dtype)
                self.state[p] = {
                    key: to_state_tensor(entry[key], p, dtype, key)
                    for key in ("exp_avg", "exp_avg_sq")
                }
