"""Helpers shared by the optimizers of :mod:`kolossos.nn.optimizer`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "PerParameterOptimizer",
    "closure_loss",
    "load_groups_then_states",
    "to_state_tensor",
    "widened",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def widened(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16 (states and arithmetic of low-precision parameters), else ``dtype``."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def load_groups_then_states(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> Iterator[tuple[dict[str, Any], Tensor, dict[str, Any] | None]]:
    """Load the param groups of ``state_dict`` with torch's checks, leaving the state empty, and
    yield ``(group, param, saved entry or None)`` for the caller to import states itself.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating state to its parameter's
    dtype, which would round fp32 states of bf16 parameters; importing them here keeps them.
    Group keys the saved dict lacks (it may come from another optimizer class) are taken from
    this optimizer's defaults.
    """
    saved = state_dict["state"]
    torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "state": {}})
    for group in optimizer.param_groups:  # a foreign (e.g. torch.optim.AdamW) dict lacks ours
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)
    ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield group, p, saved.get(next(ids))


def to_state_tensor(value: Any, p: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """A saved state value as a fresh tensor of ``dtype`` shaped like ``p``, on ``p``'s device."""
    t = torch.as_tensor(value).detach().to(device=p.device, dtype=dtype)
    if t.numel() != p.numel():
        raise ValueError(
            f"saved state {name!r} has {t.numel()} elements but its parameter has {p.numel()}: "
            "the state dict belongs to a different model"
        )
    return t.clone().reshape(p.shape)


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """``closure()`` evaluated with gradients enabled (``step()`` runs under ``no_grad``), or
    ``None`` without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class PerParameterOptimizer(torch.optim.Optimizer):
    """An optimizer that updates each parameter with a gradient on its own (Lamb, Lars):
    subclasses define :meth:`_update`."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss if a closure is given."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._update(p, group)
        return loss

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        """Update ``p`` (whose ``grad`` is set and dense) with ``group``'s hyper-parameters."""
        raise NotImplementedError
