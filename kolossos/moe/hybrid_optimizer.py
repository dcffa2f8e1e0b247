"""The optimizers of :class:`~kolossos.moe.hybrid_engine.MoeHybridParallelEngine`: dense
parameters reduced over the whole data-parallel group, expert parameters over their expert
data-parallel group only.

Why the expert gradients need no extra factor: rank ``r``'s loss ``L_r`` is the mean over its
own samples and the global loss is ``(1 / dp) * sum_r L_r``. A dense gradient is averaged over
the ``dp`` ranks. An expert on rank ``r`` already receives, through the backward all-to-all, the
gradient of every token its expert-parallel group routed to it, i.e. ``sum over the EP group of
dL_r'``; summing that over the expert data-parallel group covers all ``dp`` ranks once, so the
expert gradient is ``(1 / dp) * sum over the expert DP group``.

* :class:`MoeDDPOptimizer` (``zero_stage=0``): DDP averages the dense gradients (it ignores the
  experts); before the step the expert gradients are summed over the expert DP group and
  divided by ``dp`` (one coalesced all-reduce).
* :class:`MoeZeroOptimizer` (``zero_stage`` 1/2): two LowLevelZero optimizers, the dense one
  partitioned over the data-parallel group, the expert one over the expert DP group. The loss is
  scaled once by ``1 / dp`` before backward and both reducers *sum* — which is the average for
  the dense partitions and the expression above for the expert ones.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kolossos.cluster.collectives import all_reduce_coalesced, comm_device
from kolossos.hybrid.optimizer import HYBRID_OPTIMIZERS
from kolossos.hybrid.zero_optimizer import HybridZeroOptimizer
from kolossos.interface import OptimizerWrapper

__all__ = ["MoeDDPOptimizer", "MoeZeroOptimizer", "split_expert_groups"]

_NO_CLIP = (
    "clip_grad_by_norm with expert parallelism is not implemented (the norm would need the "
    "expert shards of every expert-parallel rank); use clip_grad_by_value, or no clipping."
)


def split_expert_groups(optimizer: Optimizer, is_expert: Any) -> tuple[Optimizer | None, list[int]]:
    """Move the expert parameters of ``optimizer`` into a new optimizer of the same class.

    ``optimizer`` keeps the dense parameters (in place); the new one holds, per original group
    with experts, one group with the same hyperparameters. Returns it (``None`` without
    experts) and, per new group, the index of the original group it mirrors."""
    groups, origin = [], []
    for i, group in enumerate(optimizer.param_groups):
        experts = [p for p in group["params"] if is_expert(p)]
        if experts:
            group["params"] = [p for p in group["params"] if not is_expert(p)]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": experts})
            origin.append(i)
    if not groups:
        return None, []
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults), origin


class MoeDDPOptimizer(OptimizerWrapper):
    """The engine's optimizer (fp32 / mixed precision) plus the expert gradient reduction.

    Args:
        base: the hybrid optimizer over all the model's parameters.
        experts: the expert parameters.
        expert_dp_group: the expert data-parallel group (``None``: one rank).
        dp_size: the whole data-parallel size.
    """

    def __init__(
        self,
        base: OptimizerWrapper,
        experts: Sequence[torch.Tensor],
        expert_dp_group: dist.ProcessGroup | None,
        dp_size: int,
    ) -> None:
        super().__init__(base.unwrap())
        self.base = base
        self.experts = experts
        self.expert_dp_group = expert_dp_group
        self.dp_size = dp_size

    def reduce_expert_grads(self) -> None:
        """Sum the expert gradients over the expert DP group and divide by ``dp_size``
        (COLLECTIVE over the expert DP group when it has more than one rank)."""
        for p in self.experts:  # every rank must pass the same tensors to the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.experts if p.grad is not None]
        if self.expert_dp_group is not None:
            all_reduce_coalesced(grads, self.expert_dp_group, comm_device(self.expert_dp_group))
        for g in grads:
            g.div_(self.dp_size)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.base.backward(loss, *args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        self.base.backward_by_grad(tensor, grad)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self.reduce_expert_grads()
        return self.base.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        raise NotImplementedError(_NO_CLIP)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        self.base.clip_grad_by_value(clip_value, *args, **kwargs)

    def working_params(self) -> list[torch.Tensor]:
        return self.base.working_params()

    def get_loss_scaler(self) -> Any:
        return self.base.get_loss_scaler()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "state_dict of the expert-parallel optimizer: optimizer checkpoints with expert "
            "parallelism are not implemented; save the model (booster.save_model) instead."
        )


class MoeZeroOptimizer(OptimizerWrapper):
    """ZeRO-1/2 for the dense parameters over the data-parallel group and for the experts over
    the expert data-parallel group, stepped together.

    Args:
        dense: the dense parameters' ZeRO optimizer (its inner optimizer is the user's).
        expert: the experts' ZeRO optimizer.
        origin: for each expert group, the index of the dense group whose hyperparameters
            (``lr`` ... set by a scheduler on the user's optimizer) it follows.
    """

    def __init__(
        self, dense: HybridZeroOptimizer, expert: HybridZeroOptimizer, origin: list[int]
    ) -> None:
        super().__init__(dense.unwrap())
        self.dense = dense
        self.expert = expert
        self.origin = origin
        self._no_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate without communication (both partitions; see LowLevelZero's)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _run(self, run: Any) -> None:
        sync = not self._no_sync
        with self.dense.backward_pass(sync=sync), self.expert.backward_pass(sync=sync):
            run(self.dense.loss_scale / self.dense.comm.world_size)  # both reducers sum

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self._run(lambda factor: (loss.float() * factor).backward(*args, **kwargs))

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        self._run(lambda factor: torch.autograd.backward(tensor, grad * factor))

    def step(self, *args: Any, **kwargs: Any) -> Any:
        dense_groups = self.dense.unwrap().param_groups
        for group, i in zip(self.expert.unwrap().param_groups, self.origin, strict=True):
            group.update({k: v for k, v in dense_groups[i].items() if k != "params"})
        out = self.dense.step(*args, **kwargs)
        self.expert.step()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        self.expert.zero_grad(set_to_none)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        raise NotImplementedError(_NO_CLIP)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        self.dense.clip_grad_by_value(clip_value)
        self.expert.clip_grad_by_value(clip_value)

    def working_params(self) -> list[torch.Tensor]:
        return [*self.dense.working_params(), *self.expert.working_params()]

    def get_loss_scaler(self) -> Any:
        return self.dense.get_loss_scaler()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "state_dict of the expert-parallel ZeRO optimizer: optimizer checkpoints with "
            "expert parallelism are not implemented; save the model (booster.save_model)."
        )


MOE_OPTIMIZERS = (MoeDDPOptimizer, MoeZeroOptimizer, *HYBRID_OPTIMIZERS)
