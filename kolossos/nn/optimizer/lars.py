"""Lars: layer-wise adaptive rate scaling (You, Gitman and Ginsburg, 2017)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kolossos.nn.optimizer._adam_base import ParamsT
from kolossos.nn.optimizer._common import (
    PerParameterOptimizer,
    load_groups_then_states,
    to_state_tensor,
    widened,
)

__all__ = ["Lars"]


class Lars(PerParameterOptimizer):
    r"""LARS, Algorithm 1 of "Large Batch Training of Convolutional Networks" (arXiv:1708.03888).

    Per parameter ``w`` with gradient ``g``:

    .. math::
        \lambda = \eta\,\frac{\lVert w\rVert}{\lVert g\rVert + \beta\lVert w\rVert + \epsilon},
        \quad v \leftarrow m\,v + \gamma\,\lambda\,(g + \beta w),\quad w \leftarrow w - v

    with ``η = eeta`` (trust coefficient), ``β = weight_decay``, ``m = momentum``, ``γ = lr`` and
    ``λ = 1`` when either norm is 0. As in the paper the momentum buffer accumulates the scaled
    step (some implementations scale after the buffer, or clip; this one follows the paper).
    Low-precision parameters get an fp32 buffer and fp32 arithmetic.

    Args:
        params: parameters or parameter-group dicts.
        lr: global learning rate ``γ``.
        momentum: momentum ``m`` (0 disables the buffer).
        eeta: trust coefficient ``η``, in ``(0, 1]``.
        weight_decay: ``β``.
        epsilon: ``ε`` in the trust ratio's denominator.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lars(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0,
        eeta: float = 1e-3,
        weight_decay: float = 0,
        epsilon: float = 0,
    ) -> None:
        checks = [
            (float(lr) >= 0, f"lr={lr!r}: the learning rate must be >= 0"),
            (float(momentum) >= 0, f"momentum={momentum!r}: momentum must be >= 0"),
            (0 < float(eeta) <= 1, f"eeta={eeta!r}: the trust coefficient must lie in (0, 1]"),
            (float(weight_decay) >= 0, f"weight_decay={weight_decay!r}: must be >= 0"),
            (float(epsilon) >= 0, f"epsilon={epsilon!r}: must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        defaults = dict(
            lr=lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon
        )
        super().__init__(params, defaults)

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        assert p.grad is not None
        dtype = widened(p.dtype)
        w, g = p.to(dtype), p.grad.to(dtype)
        wd = group["weight_decay"]
        w_norm = torch.linalg.vector_norm(w)
        g_norm = torch.linalg.vector_norm(g)
        ok = (w_norm > 0) & (g_norm > 0)
        denom = torch.where(ok, g_norm + wd * w_norm + group["epsilon"], 1.0)
        trust = torch.where(ok, group["eeta"] * w_norm / denom, 1.0)
        update = g.add(w, alpha=wd) if wd != 0 else g.clone()
        update.mul_(trust * group["lr"])
        if group["momentum"] != 0:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = update
            else:
                update = state["momentum_buffer"].mul_(group["momentum"]).add_(update)
        w.sub_(update)  # w is p itself unless p is low precision
        if w is not p:
            p.copy_(w)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping fp32 buffers for low-precision parameters."""
        for _, p, entry in load_groups_then_states(self, state_dict):
            if entry is not None and "momentum_buffer" in entry:
                buf = to_state_tensor(entry["momentum_buffer"], p, widened(p.dtype), "buffer")
                self.state[p] = {"momentum_buffer": buf}
