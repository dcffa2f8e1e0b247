"""Lamb: layer-wise adaptive moments for large-batch training (You et al., 2019)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kolossos.nn.optimizer._adam_base import ParamsT, check_hyper
from kolossos.nn.optimizer._common import (
    PerParameterOptimizer,
    load_groups_then_states,
    to_state_tensor,
    widened,
)

__all__ = ["Lamb", "trust_ratio"]

#: upper clamp of the weight norm in the trust ratio (the paper's scaling function phi)
MAX_WEIGHT_NORM = 10.0


def trust_ratio(w_norm: Tensor, r_norm: Tensor) -> Tensor:
    """``φ(‖x‖) / ‖r‖`` with ``φ(z) = min(z, 10)``, or 1 when either norm is 0."""
    w_norm = w_norm.clamp(max=MAX_WEIGHT_NORM)
    ok = (w_norm > 0) & (r_norm > 0)
    return torch.where(ok, w_norm / torch.where(ok, r_norm, 1.0), 1.0)


class Lamb(PerParameterOptimizer):
    r"""LAMB, Algorithm 2 of "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes" (You et al., ICLR 2020, arXiv:1904.00962).

    Per parameter ``x`` with gradient ``g`` at step ``t``:

    .. math::
        m = \beta_1 m + (1-\beta_1) g,\quad v = \beta_2 v + (1-\beta_2) g^2,\quad
        r = \frac{\hat m}{\sqrt{\hat v} + \epsilon} + \lambda x,\quad
        x \leftarrow x - \eta\,\frac{\phi(\lVert x\rVert)}{\lVert r\rVert}\, r

    with ``m̂ = m / (1 - β1^t)``, ``v̂ = v / (1 - β2^t)`` when ``bias_correction`` (the paper) and
    ``m̂ = m``, ``v̂ = v`` otherwise (Colossal-AI's ``Lamb`` behaves so, following arXiv v3), and
    ``φ(z) = min(z, 10)``. The trust ratio is 1 when either norm is 0, or always with
    ``adam=True``. Low-precision parameters get fp32 states and fp32 arithmetic.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate ``η``.
        betas: decay rates ``(β1, β2)``.
        eps: ``ε``, added to the denominator.
        weight_decay: ``λ``, decoupled weight decay inside the trust-scaled step.
        adam: always use trust ratio 1 (Adam with decoupled weight decay, for comparison).
        bias_correction: keyword only; see above.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lamb(model.parameters(), lr=1.8e-2, weight_decay=0.1)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        adam: bool = False,
        *,
        bias_correction: bool = True,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self.adam = adam

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        x, r = self._direction(p, group)
        if self.adam:
            trust = torch.ones((), dtype=x.dtype, device=p.device)
        else:
            trust = trust_ratio(torch.linalg.vector_norm(x), torch.linalg.vector_norm(r))
        self._apply(p, x, r, trust * group["lr"])

    def _direction(self, p: Tensor, group: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Advance ``p``'s moments; return ``(x, r)``: ``p`` in the arithmetic dtype (``p``
        itself unless low precision) and the update direction before the trust ratio."""
        beta1, beta2 = group["betas"]
        state = self.state[p]
        dtype = widened(p.dtype)
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["step"] += 1
        t = float(state["step"])
        assert p.grad is not None
        x, g = p.to(dtype), p.grad.to(dtype)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if group["bias_correction"] else (1.0, 1.0)
        r = (m / bc1).div_((v / bc2).sqrt_().add_(group["eps"]))
        if group["weight_decay"] != 0:
            r.add_(x, alpha=group["weight_decay"])
        return x, r

    @staticmethod
    def _apply(p: Tensor, x: Tensor, r: Tensor, scale: Tensor) -> None:
        """``p -= scale * r`` through ``x`` (consumes ``r``)."""
        x.sub_(r.mul_(scale))  # x is p itself unless p is low precision
        if x is not p:
            p.copy_(x)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping fp32 states for low-precision parameters."""
        for _, p, entry in load_groups_then_states(self, state_dict):
            if entry is not None:
                dtype = widened(p.dtype)
                self.state[p] = {
                    "step": torch.as_tensor(entry.get("step", 0), dtype=torch.float32).clone(),
                    "exp_avg": to_state_tensor(entry["exp_avg"], p, dtype, "exp_avg"),
                    "exp_avg_sq": to_state_tensor(entry["exp_avg_sq"], p, dtype, "exp_avg_sq"),
                }
