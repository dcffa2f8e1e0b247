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

Clipping by norm (``max_norm`` at every step, or ``clip_grad_by_norm``) uses the whole model's
norm (:func:`~kolossos.moe.grad_norm.moe_hybrid_norm`): dense gradients once (their ZeRO
partitions summed over dp), experts summed over their expert DP partitions and then over the
expert-parallel group, stages summed over the pipeline group; after the expert reduction, on
the gradients the inner optimizer steps (fp32 masters with bf16 / fp16). The inner optimizers
are built without clipping of their own.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kolossos.cluster.collectives import all_reduce_coalesced, comm_device
from kolossos.hybrid.optimizer import HYBRID_OPTIMIZERS, TPMixedPrecisionOptimizer, TPOptimizer
from kolossos.hybrid.zero_optimizer import HybridZeroOptimizer
from kolossos.interface import OptimizerWrapper
from kolossos.interface.optimizer import _check_clip
from kolossos.moe.grad_norm import clip_grads_to_norm_, moe_hybrid_norm, norm_type_of
from kolossos.moe.params import is_moe_param
from kolossos.pipeline.shared import is_pp_duplicate

__all__ = ["MoeDDPOptimizer", "MoeZeroOptimizer", "split_expert_groups"]


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
        ep_group: the expert-parallel group (``None``: one rank), for the norm.
        max_norm: clip to this global norm at every step (0: off; ``base`` must not clip).
        pp_group: the pipeline group when ``base`` holds one stage's parameters.
    """

    def __init__(
        self,
        base: TPOptimizer | TPMixedPrecisionOptimizer,
        experts: Sequence[torch.Tensor],
        expert_dp_group: dist.ProcessGroup | None,
        dp_size: int,
        *,
        ep_group: dist.ProcessGroup | None = None,
        max_norm: float = 0.0,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(base.unwrap())
        self.base = base
        self.experts = experts
        self.expert_dp_group = expert_dp_group
        self.dp_size = dp_size
        self.ep_group = ep_group
        self.max_norm = float(max_norm)
        self.pp_group = pp_group
        self._reduced = False

    def _prepare(self) -> bool:
        """Reduce the expert gradients (once per step) and, with fp32 masters, move the
        gradients to them; returns whether an fp16 overflow will skip the step."""
        if not self._reduced:
            self.reduce_expert_grads()
            self._reduced = True
        if isinstance(self.base, TPMixedPrecisionOptimizer):
            self.base._unscale()  # once per step (guarded by the base)
            return bool(self.base._found_inf)
        return False

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
        found_inf = self._prepare()
        if self.max_norm > 0 and not found_inf:
            self.clip_grad_by_norm(self.max_norm)
        self._reduced = False
        return self.base.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False
        self.base.zero_grad(set_to_none)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the gradients the step will use so the whole model's ``norm_type``-norm
        (experts counted once over the expert-parallel group, stages summed) is at most
        ``max_norm``; returns the norm before clipping (``inf`` on an fp16 overflow).
        COLLECTIVE over the expert-parallel and pipeline groups."""
        _check_clip(max_norm, "max_norm")
        norm_type = norm_type_of(norm_type)
        if self._prepare():
            return torch.tensor(math.inf)
        grads: list[torch.Tensor] = []
        dense: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []
        for group in self.base.groups:
            for p in group:
                grad = self.base.master_of(p).grad
                if grad is None:
                    continue
                grads.append(grad)
                if not is_pp_duplicate(p):
                    (experts if is_moe_param(p) else dense).append(grad)
        group_for_device = self.ep_group or self.pp_group
        total = moe_hybrid_norm(
            dense, experts, norm_type, ep_group=self.ep_group, pp_group=self.pp_group,
            device=comm_device(group_for_device),
        )  # fmt: skip
        clip_grads_to_norm_(grads, max_norm, total, error_if_nonfinite)
        return total

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        self.base.clip_grad_by_value(clip_value, *args, **kwargs)

    def working_params(self) -> list[torch.Tensor]:
        return self.base.working_params()

    def get_loss_scaler(self) -> Any:
        return self.base.get_loss_scaler()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "state_dict() of the expert-parallel optimizer is not provided (ranks hold different "
            "experts); use booster.save_optimizer / load_optimizer (states keyed by parameter "
            "name, loadable at another ep_size)."
        )


class MoeZeroOptimizer(OptimizerWrapper):
    """ZeRO-1/2 for the dense parameters over the data-parallel group and for the experts over
    the expert data-parallel group, stepped together.

    Args:
        dense: the dense parameters' ZeRO optimizer (its inner optimizer is the user's).
        expert: the experts' ZeRO optimizer.
        origin: for each expert group, the index of the dense group whose hyperparameters
            (``lr`` ... set by a scheduler on the user's optimizer) it follows.
        ep_group: the expert-parallel group (``None``: one rank), for the norm.
        max_norm: clip to this global norm at every step (0: off; neither inner optimizer
            may clip on its own).
        pp_group: the pipeline group when the optimizers hold one stage's parameters.
    """

    def __init__(
        self,
        dense: HybridZeroOptimizer,
        expert: HybridZeroOptimizer,
        origin: list[int],
        *,
        ep_group: dist.ProcessGroup | None = None,
        max_norm: float = 0.0,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(dense.unwrap())
        self.dense = dense
        self.expert = expert
        self.origin = origin
        self.ep_group = ep_group
        self.max_norm = float(max_norm)
        self.pp_group = pp_group
        self._no_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate without communication (both partitions; see LowLevelZero's)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    @contextlib.contextmanager
    def _accumulate_locally(self) -> Iterator[None]:
        with self.dense.accumulate_locally(), self.expert.accumulate_locally():
            yield

    def pipeline_backward_plan(self) -> tuple[float, AbstractContextManager[Any], Any]:
        """For a pipeline schedule: ``(loss factor, context around the schedule, backward
        router)``. The loss is scaled by ``loss_scale / dp`` (both reducers sum); ZeRO-1
        accumulates every micro-batch locally and reduces at the step, ZeRO-2 runs each
        backward as one reducer pass of both optimizers."""
        factor = float(self.dense.loss_scale) / self.dense.comm.world_size
        if self.dense.reducer.partition_grads:
            return factor, contextlib.nullcontext(), _BothReducersBackward(self)
        return factor, self._accumulate_locally(), None

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
        if self.max_norm > 0:
            self.clip_grad_by_norm(self.max_norm)
        out = self.dense.step(*args, **kwargs)
        self.expert.step()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        self.expert.zero_grad(set_to_none)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale both partitions so the whole model's ``norm_type``-norm is at most
        ``max_norm`` (dense partitions summed over dp, expert partitions over the expert DP
        group and then over the expert-parallel group); returns the norm before clipping.
        COLLECTIVE over those groups."""
        _check_clip(max_norm, "max_norm")
        norm_type = norm_type_of(norm_type)
        dense_grads, dense_inf = self.dense._prepare()
        expert_grads, expert_inf = self.expert._prepare()
        if dense_inf or expert_inf:
            return torch.tensor(math.inf)
        dense_pieces = self.dense._pieces(dense_grads, for_norm=True)
        expert_pieces = self.expert._pieces(expert_grads, for_norm=True)
        total = moe_hybrid_norm(
            [g for g, _ in dense_pieces], [g for g, _ in expert_pieces], norm_type,
            ep_group=self.ep_group, dense_partition_group=self.dense.comm.group,
            expert_partition_group=self.expert.comm.group, pp_group=self.pp_group,
            device=comm_device(self.dense.comm.group),
        )  # fmt: skip
        clip_grads_to_norm_([*dense_grads, *expert_grads], max_norm, total, error_if_nonfinite)
        return total

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        self.dense.clip_grad_by_value(clip_value)
        self.expert.clip_grad_by_value(clip_value)

    def working_params(self) -> list[torch.Tensor]:
        return [*self.dense.working_params(), *self.expert.working_params()]

    def get_loss_scaler(self) -> Any:
        return self.dense.get_loss_scaler()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "state_dict() of the expert-parallel ZeRO optimizer is not provided (ranks hold "
            "different partitions); use booster.save_optimizer / load_optimizer (states keyed "
            "by parameter name, loadable at another ep_size or zero_stage)."
        )


class _BothReducersBackward:
    """A schedule's backward router for ZeRO-2: each backward is one reducer pass of the dense
    and the expert optimizer (the loss is already scaled)."""

    def __init__(self, optimizer: MoeZeroOptimizer) -> None:
        self.optimizer = optimizer

    def backward(self, loss: torch.Tensor) -> None:
        o = self.optimizer
        with o.dense.backward_pass(sync=True), o.expert.backward_pass(sync=True):
            loss.backward()

    def backward_by_grad(self, tensors: Any, grads: Any) -> None:
        o = self.optimizer
        with o.dense.backward_pass(sync=True), o.expert.backward_pass(sync=True):
            torch.autograd.backward(tensors, grads)


MOE_OPTIMIZERS = (MoeDDPOptimizer, MoeZeroOptimizer, *HYBRID_OPTIMIZERS)
