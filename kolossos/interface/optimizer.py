"""``OptimizerWrapper``: what a plugin returns for an optimizer.

It forwards the ``torch.optim.Optimizer`` interface and adds ``backward`` (so a wrapper can scale
the loss or hook gradients), clipping by norm and by value, ``unwrap``, and the contract the
Booster and checkpoint IO rely on: the model parameters behind the optimized tensors
(:meth:`~OptimizerWrapper.working_params`), their names, master-weight resynchronisation and the
loss scaler. Subclasses override what differs; the defaults describe a plain optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.interface.model import unwrap_model
from kolossos.interface.protocols import GradNormFn, LossScaler


class OptimizerWrapper:
    """Wraps a ``torch.optim.Optimizer``; subclasses change how backward, step and clipping work.

    Args:
        optim: the optimizer to wrap.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> opt.backward(model(torch.ones(1, 2)).sum())
        >>> opt.clip_grad_by_norm(1.0)  # doctest: +ELLIPSIS
        tensor(...)
        >>> opt.step(); opt.zero_grad()
    """

    #: the global gradient norm used by :meth:`clip_grad_by_norm` when gradients are split across
    #: ranks in a way this wrapper does not know (set by the engine that split them, e.g. the
    #: legacy Engine under tensor or pipeline parallelism); ``None``: the local norm
    grad_norm_fn: GradNormFn | None = None

    def __init__(self, optim: Optimizer) -> None:
        if not isinstance(optim, Optimizer):
            raise TypeError(
                f"expected a torch.optim.Optimizer, got {type(optim).__name__}; build the "
                "optimizer over the model's parameters and pass it to booster.boost."
            )
        self.optim = optim
        self._param_names: dict[torch.Tensor, str] = {}

    # --- the torch.optim.Optimizer interface ------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyper-parameters."""
        return self.optim.defaults

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optim.state

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter the optimizer updates."""
        for group in self.optim.param_groups:
            yield from group["params"]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Update the parameters."""
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict into the wrapped optimizer."""
        self.optim.load_state_dict(state_dict)

    # --- additions ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (subclasses scale it, or route gradients elsewhere)."""
        loss.backward(*args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with an explicit upstream gradient (pipeline stages)."""
        torch.autograd.backward(tensor, grad)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters() if p.grad is not None]

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale gradients so their global ``norm_type``-norm is at most ``max_norm``.

        Under data parallelism the gradients are already averaged (identical on every rank), so
        the local norm is the global one; sharding plugins override this.

        Returns:
            The total norm before clipping.
        """
        _check_clip(max_norm, "max_norm")
        params = [p for p in self.parameters() if p.grad is not None]
        return self._clip_params(params, max_norm, norm_type, error_if_nonfinite)

    def _clip_params(
        self,
        params: Sequence[torch.Tensor],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
    ) -> torch.Tensor:
        """Clip the gradients of ``params`` (tensors this wrapper steps) by their global norm:
        torch's local norm, or :attr:`grad_norm_fn`'s when set. Returns the norm."""
        if self.grad_norm_fn is None:
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
            )
        behind: dict[torch.Tensor, torch.Tensor] = dict(
            zip(self.parameters(), self.working_params(), strict=True)
        )
        pairs = [(p.grad, behind.get(p, p)) for p in params if p.grad is not None]
        total = self.grad_norm_fn(pairs, float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"the total gradient norm of order {norm_type} is {float(total)}: some gradient "
                "is NaN or infinite, so it cannot be clipped; pass error_if_nonfinite=False to "
                "clip anyway, or find the layer that overflowed."
            )
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Clamp every gradient element into ``[-clip_value, clip_value]``."""
        _check_clip(clip_value, "clip_value")
        params = [p for p in self.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_value_(params, clip_value)

    # --- the contract with the Booster and checkpoint IO ----------------------------------------
    def working_params(self) -> list[torch.Tensor]:
        """The model parameter behind each tensor of :meth:`parameters`, in the same order.

        A wrapper stepping fp32 master copies returns the (low-precision) parameter each master
        mirrors; a plain optimizer steps the model's parameters themselves.
        """
        return list(self.parameters())

    def sync_master_weights(self) -> None:
        """Let master copies follow model weights changed from outside (a loaded model
        checkpoint); nothing to do without master copies."""

    def get_loss_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler of this wrapper or of the wrapper it wraps (``None``: no loss
        scaling). Optimizer checkpoints save and restore its state."""
        inner = self.optim
        return inner.get_loss_scaler() if isinstance(inner, OptimizerWrapper) else None

    def set_param_names(self, names: nn.Module | Mapping[torch.Tensor, str]) -> None:
        """Name the model parameters (for name-keyed checkpoints): from a model (wrappers are
        stripped; a tied parameter keeps its first name) or a ``{parameter: name}`` mapping."""
        if isinstance(names, nn.Module):
            names = {p: n for n, p in unwrap_model(names).named_parameters()}
        self._param_names = dict(names)

    def has_param_names(self) -> bool:
        """Whether :meth:`set_param_names` was called."""
        return bool(self._param_names)

    def param_name(self, param: torch.Tensor) -> str | None:
        """The name of model parameter ``param`` (see :meth:`set_param_names`), if known."""
        return self._param_names.get(param)

    def unwrap(self) -> Optimizer:
        """The innermost ``torch.optim.Optimizer``."""
        optim: Any = self.optim
        while isinstance(optim, OptimizerWrapper):
            optim = optim.optim
        return optim

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"


def _check_clip(value: float, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number, e.g. 1.0.")
    if math.isinf(value):
        raise ValueError(f"{name}=inf clips nothing; omit the call instead.")
