"""FusedSGD: SGD with momentum, Nesterov and weight decay as multi-tensor ``torch._foreach_*``
calls (Colossal-AI's and apex's ``FusedSGD``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import required

from kolossos.nn.optimizer._adam_base import ParamsT
from kolossos.nn.optimizer._common import closure_loss

__all__ = ["FusedSGD"]


class FusedSGD(torch.optim.Optimizer):
    r"""Stochastic gradient descent with optional momentum, a drop-in for ``torch.optim.SGD``.

    Per parameter ``p`` with gradient ``g`` (``λ`` weight decay, ``μ`` momentum, ``τ``
    dampening, ``b`` the momentum buffer, which starts as the first ``g``):

    .. math::
        g \leftarrow g + \lambda p,\quad b \leftarrow \mu b + (1-\tau) g,\quad
        g \leftarrow g + \mu b \text{ (Nesterov) or } b,\quad p \leftarrow p - \eta g

    which is ``torch.optim.SGD``'s update, op for op (the tests check equality). With
    ``wd_after_momentum=True`` the ``λp`` term is added after the momentum step instead (apex's
    option). Upstream needs a CUDA extension; this runs ``torch._foreach_*`` on any device.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate ``η`` (required, as in Colossal-AI).
        momentum: momentum factor ``μ``.
        dampening: dampening ``τ`` of the momentum.
        weight_decay: L2 penalty ``λ``.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        wd_after_momentum: add the weight decay after the momentum update.

    Raises:
        TypeError: ``lr`` is not given.
        ValueError: a negative ``lr``, ``momentum`` or ``weight_decay``, or Nesterov without
            momentum or with dampening.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = required,  # type: ignore[assignment]
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
    ) -> None:
        if lr is required:
            raise TypeError("FusedSGD needs a learning rate: pass lr=..., e.g. lr=0.1.")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not float(value) >= 0.0:
                raise ValueError(f"FusedSGD({name}={value!r}): {name} must be >= 0.")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"FusedSGD(nesterov=True, momentum={momentum}, dampening={dampening}): Nesterov "
                "momentum needs momentum > 0 and dampening=0."
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss if a closure is given."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("FusedSGD does not support sparse gradients")
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        wd, mu = group["weight_decay"], group["momentum"]
        grads = [p.grad.to(p.dtype) for p in params]  # type: ignore[union-attr]
        if wd != 0 and not self.wd_after_momentum:
            grads = list(torch._foreach_add(grads, params, alpha=wd))
        if mu != 0:
            has = [self.state[p].get("momentum_buffer") is not None for p in params]
            old = [(p, g) for p, g, h in zip(params, grads, has, strict=True) if h]
            for p, g, h in zip(params, grads, has, strict=True):
                if not h:  # torch.optim.SGD: the first buffer is the gradient itself
                    self.state[p]["momentum_buffer"] = torch.clone(g).detach()
            if old:
                bufs = [self.state[p]["momentum_buffer"] for p, _ in old]
                torch._foreach_mul_(bufs, mu)
                torch._foreach_add_(bufs, [g for _, g in old], alpha=1 - group["dampening"])
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            nesterov = group["nesterov"]
            grads = list(torch._foreach_add(grads, bufs, alpha=mu)) if nesterov else bufs
        if wd != 0 and self.wd_after_momentum:
            grads = list(torch._foreach_add(grads, params, alpha=wd))
        torch._foreach_add_(params, grads, alpha=-group["lr"])
