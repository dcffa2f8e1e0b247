"""What the zero_stage-0 optimizers of :class:`HybridParallelPlugin` share: TP-aware gradient
clipping and the per-parameter state interface its checkpoint IO talks to.

The checkpoint interface is the one :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`
already has (``groups``, ``param_name``, ``full_param``, ``load_full_param``,
``full_param_states``, ``load_param_states``), so
:class:`~kolossos.hybrid.checkpoint_io.HybridParallelCheckpointIO` treats
both alike. "Full" there means full over the data-parallel group; the values are still this
rank's tensor-parallel shard (the checkpoint IO gathers those).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kolossos.cluster.collectives import all_reduce_coalesced, comm_device
from kolossos.hybrid.grad_norm import tp_global_norm
from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec, is_sequence_parallel
from kolossos.pipeline.shared import is_pp_duplicate
from kolossos.zero.low_level.clip import check_finite_norm, clip_by_total_norm_

__all__ = ["TPStateMixin"]


class TPStateMixin:
    """Clipping and checkpoint state of an optimizer over a tensor-parallel model (a mixin).

    The host class sets ``optim``, ``groups`` (the model's parameters, group by group),
    ``tp_group`` and implements :meth:`master_of`.
    """

    optim: Optimizer
    groups: list[list[torch.Tensor]]
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None = None
    """the pipeline group (``pp_size > 1``): the norm sums over the stages"""

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the wrapped optimizer steps for model parameter ``param``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ sequence parallelism
    def _sum_sequence_parallel_grads(self) -> None:
        """Sum the working gradients of sequence-parallel parameters over the TP group, once per
        step, before unscaling and clipping, in one all-reduce per dtype.

        Under Megatron sequence parallelism the layer norms (and row-parallel biases) run on
        each rank's slice of the sequence, so each rank's gradient of these replicated
        parameters covers only its tokens; the full gradient is their sum over the TP group.
        Summing after the data-parallel reduction and after accumulation is exact: every step
        in between is a sum too."""
        grads = [
            p.grad
            for group in self.groups
            for p in group
            if p.grad is not None and is_sequence_parallel(p)
        ]
        all_reduce_coalesced(grads, self.tp_group, comm_device(self.tp_group))

    # ------------------------------------------------------------------ clipping
    def _clip_tp(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """Clip the masters' gradients to a global norm counting each element once."""
        pairs = [(p, self.master_of(p)) for group in self.groups for p in group]
        grads = [(m.grad, get_tp_spec(p) is not None) for p, m in pairs if m.grad is not None]
        counted = [
            (m.grad, get_tp_spec(p) is not None)
            for p, m in pairs
            if m.grad is not None and not is_pp_duplicate(p)
        ]
        total = tp_global_norm(
            counted,
            float(norm_type),
            self.tp_group,
            device=comm_device(self.tp_group),
            pp_group=self.pp_group,
        )
        check_finite_norm(total, norm_type, error_if_nonfinite)
        clip_by_total_norm_([grad for grad, _ in grads], max_norm, total)
        return total

    # ------------------------------------------------------------------ checkpoint state
    def full_param(self, param: torch.Tensor, dst: int | None = None) -> torch.Tensor:
        """This rank's TP shard of ``param`` at master precision (no communication: data-
        parallel ranks hold the same values)."""
        return self.master_of(param).detach()

    @torch.no_grad()
    def load_full_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``param`` (in its dtype) and its master (at full precision) from ``value``."""
        param.copy_(value.reshape(param.shape))
        master = self.master_of(param)
        if master is not param:
            master.copy_(value.reshape(master.shape))

    def full_param_states(
        self, dst: int | None = None
    ) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """Yield ``(group, index, state)`` for every parameter with optimizer state."""
        for g, group in enumerate(self.groups):
            for i, param in enumerate(group):
                state = self.optim.state.get(self.master_of(param))
                if state:
                    yield g, i, dict(state)

    def load_param_states(self, items: Iterable[tuple[int, int, Mapping[str, Any]]]) -> None:
        """Replace the optimizer state by ``(group, index, state)`` items (values with the
        parameter's shape must be this rank's shard)."""
        self.optim.state.clear()
        for g, i, state in items:
            master = self.master_of(self.groups[g][i])
            self.optim.state[master] = {
                key: _like_master(value, master, key) for key, value in state.items()
            }


def _like_master(value: Any, master: torch.Tensor, key: str) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if key != "step" and value.shape == master.shape and value.is_floating_point():
        return value.to(device=master.device, dtype=master.dtype, copy=True)
    return value.clone()
