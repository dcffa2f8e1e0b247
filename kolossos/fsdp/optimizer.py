"""The optimizer side of FSDP2: re-pointing an optimizer at the sharded parameters, global-norm
clipping over ``DTensor`` shards, and fp16 loss scaling.

After ``fully_shard`` a model's parameters are new ``Parameter`` objects (``DTensor`` shards).
An optimizer built before sharding (the Booster's order) still holds the old tensors;
:func:`rebind_params` swaps them by parameter name, keeping groups and hyper-parameters.

Gradients are ``DTensor`` shards too. :class:`FSDPOptimizer` clips and unscales on the local
shards and reduces only what must be global (the norm, the overflow flag), so it works whatever
device the shards live on (CPU offload included) and costs one scalar all-reduce per mesh
dimension that shards.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.amp import BaseGradScaler, all_reduce_overflow, unscale_and_check_
from kolossos.interface.optimizer import OptimizerWrapper, _check_clip

__all__ = ["FSDPOptimizer", "global_grad_norm", "rebind_params"]


def rebind_params(optim: Optimizer, before: dict[str, Any], model: nn.Module) -> None:
    """Replace the optimizer's parameters by the model's current ones of the same name.

    Args:
        optim: the optimizer built over the model before sharding (no state yet).
        before: ``{name: parameter}`` of the model before sharding
            (``named_parameters(remove_duplicate=False)``).
        model: the sharded model.

    Raises:
        ValueError: the optimizer already has state, or holds a tensor that is not a parameter
            of the model.
    """
    if any(optim.state.values()):
        raise ValueError(
            "the optimizer already has state (it stepped before booster.boost); boost the model "
            "and optimizer before the first step, or load the state after boosting."
        )
    after = dict(model.named_parameters(remove_duplicate=False))
    moved = {id(old): after[name] for name, old in before.items() if name in after}
    for g, group in enumerate(optim.param_groups):
        params = group["params"]
        for i, param in enumerate(params):
            if id(param) not in moved:
                raise ValueError(
                    f"optimizer param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}) "
                    "is not a parameter of the boosted model; build the optimizer over "
                    "model.parameters()."
                )
            params[i] = moved[id(param)]  # in place: some optimizers keep the list object


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores (the shard of a ``DTensor``)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _shard_groups(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The groups of the mesh dimensions over which a ``DTensor`` is sharded (not replicated)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return ()
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    return tuple(mesh.get_group(d) for d, p in enumerate(placements) if p.is_shard())


def global_grad_norm(
    params: list[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of ``params``, as if they were whole (collective).

    Local shards are reduced over the mesh dimensions that shard them; replicated dimensions
    hold copies and are not counted twice. Plain tensors count as they are. Every rank passes
    the same parameters (a missing gradient counts as zero), so the reductions line up.
    """
    inf = math.isinf(norm_type)
    partial: dict[tuple[Any, ...], torch.Tensor] = {}
    with torch.no_grad():
        for param in params:
            key = _shard_groups(param)
            part = torch.zeros((), dtype=torch.float32, device=device)
            if param.grad is not None:
                local = _local(param.grad)
                part = torch.linalg.vector_norm(local, norm_type, dtype=torch.float32).to(device)
                part = part if inf else part.pow(norm_type)
            previous = partial.get(key)
            if previous is not None:
                part = torch.maximum(previous, part) if inf else previous + part
            partial[key] = part
        totals = []
        for groups, value in partial.items():
            for group in groups:  # sync point: one scalar all-reduce per sharded mesh dimension
                op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
                dist.all_reduce(value, op=op, group=group)
            totals.append(value)
        if not totals:
            return torch.zeros((), device=device)
        stacked = torch.stack(totals)
        return stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)


class FSDPOptimizer(OptimizerWrapper):
    """The optimizer :class:`~kolossos.booster.plugin.TorchFSDPPlugin` returns.

    Args:
        optim: the optimizer over the sharded parameters.
        device: where scalar reductions run (the communication device).
        scaler: a loss scaler for fp16 compute; ``None`` otherwise.
        group: the data-parallel group that agrees on fp16 overflows (default: the world).

    Example:
        >>> optimizer.clip_grad_by_norm(1.0)  # global norm over every shard  # doctest: +SKIP
    """

    def __init__(
        self,
        optim: Optimizer,
        device: torch.device,
        scaler: BaseGradScaler | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(optim)
        self.device = device
        self.scaler = scaler
        self.group = group
        self._unscaled = False
        self._found_inf = False

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def get_loss_scaler(self) -> BaseGradScaler | None:
        """The fp16 loss scaler (``None`` without fp16 compute)."""
        return self.scaler

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step`` was skipped because some rank overflowed (fp16)."""
        return self._found_inf

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (times the loss scale under fp16)."""
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        loss.backward(*args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with ``grad`` (scaled under fp16)."""
        torch.autograd.backward(tensor, grad * self.loss_scale)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters() if p.grad is not None]

    def _unscale(self) -> None:
        """Unscale the local shards once per step and agree on overflow (fp16 only)."""
        if self.scaler is None or self._unscaled:
            return
        flag = unscale_and_check_([_local(g) for g in self._grads()], self.scaler.inv_scale)
        self._found_inf = all_reduce_overflow(flag, self.group)  # sync point
        self._unscaled = True

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale gradients so their global norm is at most ``max_norm``; returns that norm
        before clipping (``inf`` when an fp16 step will be skipped)."""
        _check_clip(max_norm, "max_norm")
        self._unscale()
        if self._found_inf:
            return torch.tensor(float("inf"))
        total = global_grad_norm(list(self.parameters()), float(norm_type), self.device)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite; set "
                "error_if_nonfinite=False to clip anyway."
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in self._grads():
                local = _local(grad)
                local.mul_(coef.to(local.device, local.dtype))
        return total

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Clamp every gradient element into ``[-clip_value, clip_value]``."""
        _check_clip(clip_value, "clip_value")
        self._unscale()
        if self._found_inf:
            return
        with torch.no_grad():
            for grad in self._grads():
                _local(grad).clamp_(-clip_value, clip_value)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Update the parameters; under fp16, skip the step on every rank if any overflowed.

        Returns:
            The wrapped optimizer's return value, or ``None`` for a skipped step.
        """
        if self.scaler is None:
            return self.optim.step(*args, **kwargs)
        self._unscale()
        self._unscaled = False
        self.scaler.update(self._found_inf)
        if self._found_inf:
            self.zero_grad()
            return None
        return self.optim.step(*args, **kwargs)
