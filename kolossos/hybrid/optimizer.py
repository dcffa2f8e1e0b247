"""Optimizers of :class:`HybridParallelPlugin` with ``zero_stage=0`` (DDP over data parallelism).

* :class:`TPOptimizer` (``precision='fp32'``): the user's optimizer over the sharded parameters.
* :class:`TPMixedPrecisionOptimizer` (``'fp16'`` / ``'bf16'``): fp32 master copies of the
  low-precision working parameters; fp16 scales the loss dynamically
  (:class:`kolossos.amp.DynamicGradScaler`), and every rank (all TP and DP ranks) takes the same
  skip-or-step decision.

Both clip by the global norm of the whole (unsharded) model (``max_norm`` at every step, or
``clip_grad_by_norm``), see :mod:`~kolossos.hybrid.grad_norm`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kolossos.amp import BaseGradScaler
from kolossos.amp.loss_scaled_optimizer import LossScaledOptimizer
from kolossos.hybrid.tp_state import TPStateMixin
from kolossos.hybrid.zero_optimizer import HybridZeroOptimizer
from kolossos.interface import OptimizerWrapper
from kolossos.interface.optimizer import _check_clip

__all__ = ["HYBRID_OPTIMIZERS", "HybridOptimizer", "TPMixedPrecisionOptimizer", "TPOptimizer"]


def _groups(optim: Optimizer) -> list[list[torch.Tensor]]:
    return [list(group["params"]) for group in optim.param_groups]


class TPOptimizer(TPStateMixin, OptimizerWrapper):
    """fp32 training of a tensor-parallel model (gradients already averaged over DP by DDP).

    Args:
        optim: an optimizer over the sharded model's parameters.
        tp_group: the tensor-parallel group.
        max_norm: clip to this global norm at every step (0: off).
        pp_group: the pipeline group (the norm then sums over the stages).

    Example:
        >>> opt = TPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tp_group, 1.0)
        ... # doctest: +SKIP
    """

    def __init__(
        self,
        optim: Optimizer,
        tp_group: dist.ProcessGroup | None,
        max_norm: float = 0.0,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(optim)
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.max_norm = float(max_norm)
        self.groups = _groups(optim)
        self._sp_summed = False

    def _prepare(self) -> None:
        if not self._sp_summed:
            self._sum_sequence_parallel_grads()
            self._sp_summed = True

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter itself (fp32 weights are their own masters)."""
        return param

    def working_params(self) -> list[torch.Tensor]:
        """The model's parameters, in optimizer order."""
        return list(self.parameters())

    def sync_master_weights(self) -> None:
        """Nothing to do: there are no separate master copies."""

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale gradients so the whole model's ``norm_type``-norm is at most ``max_norm``;
        returns the norm before clipping (a collective over the TP group)."""
        _check_clip(max_norm, "max_norm")
        self._prepare()
        return self._clip_tp(max_norm, norm_type, error_if_nonfinite)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Sum the sequence-parallel gradients, clip (with ``max_norm``), then step."""
        self._prepare()
        if self.max_norm > 0:
            self._clip_tp(self.max_norm, 2.0, False)
        out = self.optim.step(*args, **kwargs)
        self._sp_summed = False
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients."""
        super().zero_grad(set_to_none)
        self._sp_summed = False


class TPMixedPrecisionOptimizer(TPStateMixin, LossScaledOptimizer):
    """fp16/bf16 working weights with fp32 masters, over a tensor-parallel model.

    Args:
        optim: an optimizer over the sharded model's (low-precision) parameters; it is re-pointed
            at fp32 master copies.
        scaler: the loss scaler (dynamic for fp16, constant 1 for bf16).
        tp_group: the tensor-parallel group.
        max_norm: clip to this global norm at every step (0: off).
        pp_group: the pipeline group (the norm then sums over the stages).
    """

    def __init__(
        self,
        optim: Optimizer,
        scaler: BaseGradScaler,
        tp_group: dist.ProcessGroup | None,
        max_norm: float = 0.0,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.groups = _groups(optim)  # before the masters replace them in the param groups
        # group=None: every rank of the job agrees on overflow (TP shards and stages differ).
        super().__init__(optim, scaler, master_weights=True, group=None)
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.max_norm = float(max_norm)
        self._master = {work: master for master, work in self._working.items()}

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master copy of ``param`` (itself if ``param`` is fp32)."""
        return self._master.get(param, param)

    def _unscale(self) -> None:
        if not self._unscaled:  # once per step, before the gradients move to the masters
            self._sum_sequence_parallel_grads()
        super()._unscale()

    @torch.no_grad()
    def sync_master_weights(self) -> None:
        """Let the fp32 masters follow working weights changed from outside (e.g. a model
        checkpoint loaded into the model); masters whose rounding already equals the working
        weight keep their full precision (checkpoint IO loads them exactly)."""
        for master, work in self._working.items():
            if not torch.equal(master.to(work.dtype), work):
                master.copy_(work.float())

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Unscale, then clip the masters' gradients to a whole-model norm of ``max_norm``;
        returns the norm before clipping (``inf`` when an overflow will skip the step)."""
        _check_clip(max_norm, "max_norm")
        self._unscale()
        if self._found_inf:
            return torch.tensor(float("inf"))
        return self._clip_tp(max_norm, norm_type, error_if_nonfinite)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Unscale, clip (with ``max_norm``), then step unless any rank overflowed."""
        self._unscale()
        if self.max_norm > 0 and not self._found_inf:
            self._clip_tp(self.max_norm, 2.0, False)
        return super().step(*args, **kwargs)


#: every optimizer wrapper the hybrid engine builds
HybridOptimizer = TPOptimizer | TPMixedPrecisionOptimizer | HybridZeroOptimizer
HYBRID_OPTIMIZERS = (TPOptimizer, TPMixedPrecisionOptimizer, HybridZeroOptimizer)
