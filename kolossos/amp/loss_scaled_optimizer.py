"""``LossScaledOptimizer``: fp16 training with a dynamic loss scale around any optimizer.

Two layouts share one step logic:

* **in place** (``master_weights=False``, torch-AMP style): parameters stay fp32 and autocast
  computes in fp16; gradients arrive scaled in the parameters' ``.grad`` and are unscaled in place.
* **master weights** (``master_weights=True``, "naive" AMP): the model holds fp16 parameters, the
  optimizer steps fp32 master copies; scaled fp16 gradients are unscaled into the masters' fp32
  ``.grad`` and the updated masters are copied back into the fp16 parameters.

Step protocol (every rank takes the same decision): unscale (at most once per step — clipping
unscales first, as with ``torch.amp.GradScaler.unscale_``), agree on overflow across ranks, then
either skip the step (gradients dropped, scale backed off) or step and let the scale grow.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kolossos.amp.grad_scaler import BaseGradScaler
from kolossos.amp.overflow import all_reduce_overflow, unscale_and_check_
from kolossos.interface.optimizer import OptimizerWrapper, _check_clip
from kolossos.logging import get_dist_logger


class LossScaledOptimizer(OptimizerWrapper):
    """Scale the loss in ``backward``, unscale and check gradients before ``step``.

    Args:
        optim: an optimizer over the model's parameters (fp32, or fp16 with ``master_weights``).
        scaler: decides the loss scale (shared implementation: :mod:`kolossos.amp`).
        master_weights: keep fp32 master copies of low-precision parameters (see module doc).
        group: the process group that must agree on overflow (default: all ranks).
        count_zeros: count zero gradient elements at every step (``num_zeros_in_grad``).
        verbose: log the zero count (with ``count_zeros``) on rank 0.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = LossScaledOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                           DynamicGradScaler(initial_scale=2**8))
        >>> opt.backward(model(torch.ones(1, 2)).sum()); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        optim: Optimizer,
        scaler: BaseGradScaler,
        master_weights: bool = False,
        group: dist.ProcessGroup | None = None,
        count_zeros: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__(optim)
        self.scaler = scaler
        self.count_zeros = count_zeros
        self.verbose = verbose
        #: zero gradient elements at the last step (only with ``count_zeros``)
        self.num_zeros_in_grad: int | None = None
        self.group = group
        self.master_weights = master_weights
        self._unscaled = False
        self._found_inf = False
        #: fp32 master -> the working (low-precision) parameter it mirrors
        self._working: dict[torch.Tensor, torch.Tensor] = {}
        if master_weights:
            self._build_masters()

    def _build_masters(self) -> None:
        for group in self.optim.param_groups:
            masters = []
            for p in group["params"]:
                if p.dtype in (torch.float16, torch.bfloat16):
                    master = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                    self._working[master] = p
                    masters.append(master)
                else:
                    masters.append(p)
            group["params"] = masters

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.scaler.scale

    def get_loss_scaler(self) -> BaseGradScaler:
        """The loss scaler (its state travels with optimizer checkpoints)."""
        return self.scaler

    def working_params(self) -> list[torch.Tensor]:
        """The parameters the model computes with (fp16 ones in the master-weights layout)."""
        return [self._working.get(p, p) for p in self.parameters()]

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss * scale``."""
        (loss.float() * self.scaler.scale).backward(*args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with ``grad * scale``."""
        torch.autograd.backward(tensor, grad * self.scaler.scale)

    def _unscale(self) -> None:
        """Move gradients to where the optimizer reads them, unscaled; record the local overflow."""
        if self._unscaled:
            return
        if self.master_weights:
            for master, work in self._working.items():
                if work.grad is not None:
                    master.grad = work.grad.float()
                    work.grad = None
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        local = unscale_and_check_(grads, self.scaler.inv_scale)
        # SYNC POINT: every rank must take the same skip-or-step decision.
        self._found_inf = all_reduce_overflow(local, self.group)
        self._unscaled = True
        if self.count_zeros:
            self.num_zeros_in_grad = int(sum(int((g == 0).sum()) for g in grads))
            if self.verbose:
                get_dist_logger().info(f"zeros in grad: {self.num_zeros_in_grad}", ranks=[0])

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Unscale, then clip to a global norm of ``max_norm``; returns the norm before clipping
        (non-finite when the step will be skipped for overflow)."""
        _check_clip(max_norm, "max_norm")
        self._unscale()
        params = [p for p in self.parameters() if p.grad is not None]
        if self._found_inf:  # the step is skipped anyway; don't let clipping raise or mix NaNs
            return torch.tensor(float("inf"))
        return self._clip_params(params, max_norm, norm_type, error_if_nonfinite)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Unscale, then clamp every gradient element into ``[-clip_value, clip_value]``."""
        _check_clip(clip_value, "clip_value")
        self._unscale()
        if not self._found_inf:
            params = [p for p in self.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_value_(params, clip_value)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Step unless any rank overflowed; update the loss scale either way.

        Returns:
            The wrapped optimizer's return value, or ``None`` for a skipped step.
        """
        self._unscale()
        skipped = self._found_inf
        self._unscaled = False
        self.scaler.update(skipped)
        if skipped:
            self.zero_grad()
            return None
        out = self.optim.step(*args, **kwargs)
        if self.master_weights:
            with torch.no_grad():
                for master, work in self._working.items():
                    work.copy_(master)
        return out

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step`` was skipped for overflow."""
        return self._found_inf

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset master and working gradients."""
        self.optim.zero_grad(set_to_none=set_to_none)
        for work in self._working.values():
            if set_to_none:
                work.grad = None
            elif work.grad is not None:
                work.grad.zero_()
        self._unscaled = False

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the loss scaler's (key ``"loss_scaler"``)."""
        state = self.optim.state_dict()
        state["loss_scaler"] = self.scaler.state_dict()
        return state

    def sync_master_weights(self) -> None:
        """Copy the working parameters into the fp32 masters (after loading model weights)."""
        with torch.no_grad():
            for master, work in self._working.items():
                master.copy_(work.float())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state (and the loss scaler's, when present)."""
        state = dict(state_dict)
        scaler_state = state.pop("loss_scaler", None)
        self.optim.load_state_dict(state)
        if scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        self.sync_master_weights()  # masters follow the (separately loaded) model weights
