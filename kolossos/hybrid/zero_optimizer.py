"""``HybridZeroOptimizer``: LowLevelZero (ZeRO-1/2) over the data-parallel axis of a
tensor-parallel model.

Each data-parallel group holds one TP shard of the model, so the flat buffers, partitions and
gradient reduction of :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer` work unchanged
inside it. Two decisions need the other TP ranks too:

* the gradient norm: each rank's partition mixes TP-sharded parameters (summed over the TP
  group) and replicated ones (counted once), see
  :mod:`~kolossos.hybrid.grad_norm`;
* the fp16 overflow: TP ranks hold different gradients, and all of them must skip together;
* the gradients of sequence-parallel parameters, summed over the TP group on the partitions
  (one all-reduce per step, as :class:`~kolossos.hybrid.tp_state.TPStateMixin` does).

With pipeline parallelism the overflow flag and the norm are also agreed over the pipeline group,
and ZeRO-1 accumulates a whole pipeline step locally (:meth:`accumulate_locally`), reducing once
at the optimizer step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kolossos.amp import all_reduce_overflow
from kolossos.cluster.collectives import all_reduce_coalesced, comm_device
from kolossos.hybrid.grad_norm import tp_global_norm
from kolossos.interface.optimizer import _check_clip
from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec, is_sequence_parallel
from kolossos.pipeline.shared import is_pp_duplicate
from kolossos.zero.low_level import LowLevelZeroOptimizer
from kolossos.zero.low_level.clip import check_finite_norm, clip_by_total_norm_
from kolossos.zero.low_level.options import check_norm_type
from kolossos.zero.low_level.state_io import local_piece

__all__ = ["HybridZeroOptimizer"]


class HybridZeroOptimizer(LowLevelZeroOptimizer):
    """ZeRO-1/2 over ``dp_process_group`` with TP-aware clipping and overflow agreement.

    Args:
        optimizer: the optimizer over the sharded model's parameters.
        tp_group: the tensor-parallel group.
        pp_group: the pipeline group (``pp_size > 1``), or ``None``.
        **kwargs: :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`'s arguments
            (``dp_process_group`` included).
    """

    narrow_grads = False
    """fp32 gradient copies: the sequence-parallel gradients are summed over the tensor-parallel
    group in place, which on bf16 partitions would round the sums to bf16"""

    def __init__(
        self,
        optimizer: Optimizer,
        tp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        self.tp_group = tp_group
        self.pp_group = pp_group
        super().__init__(optimizer, **kwargs)

    def _tp_active(self) -> bool:
        return self.tp_group is not None and dist.get_world_size(self.tp_group) > 1

    def _pp_active(self) -> bool:
        return self.pp_group is not None and dist.get_world_size(self.pp_group) > 1

    def accumulate_locally(self) -> AbstractContextManager[None]:
        """One backward pass for the reducer around a whole pipeline step (ZeRO-1): every
        micro-batch's backward (also split ``B``/``W`` ones) accumulates into the flat gradient
        buffer, and the reduction over the data-parallel group happens once, at the step."""
        return self.backward_pass(sync=False)

    def _prepare(self) -> tuple[list[torch.Tensor | None], bool]:
        if self._prepared is not None:
            return self._prepared
        grads, found_inf = super()._prepare()
        if self._tp_active() or self._pp_active():
            if self.scaler is not None:
                for group in (self.tp_group, self.pp_group):
                    if group is not None and dist.get_world_size(group) > 1:
                        found_inf = all_reduce_overflow(found_inf, group)  # SYNC POINT
            if not found_inf and self._tp_active():
                pieces = [g for g, sharded in self._pieces(grads, sequence_parallel=True)]
                all_reduce_coalesced(pieces, self.tp_group, comm_device(self.tp_group))
            self._prepared = (grads, found_inf)
        return grads, found_inf

    def _pieces(
        self,
        grads: list[torch.Tensor | None],
        sequence_parallel: bool = False,
        for_norm: bool = False,
    ) -> list[tuple[torch.Tensor, bool]]:
        """This rank's gradient partition cut per parameter, each tagged TP-sharded or not
        (``sequence_parallel``: only the pieces of sequence-parallel parameters; ``for_norm``:
        without the copies of parameters tied across pipeline stages that another stage
        counts)."""
        pieces = []
        for g, (grad, layout) in enumerate(zip(grads, self.layouts, strict=True)):
            if grad is None:
                continue
            for span, param in zip(layout.spans, self.groups[g], strict=True):
                piece = local_piece(layout, self.comm.rank, span)
                if piece is None or (sequence_parallel and not is_sequence_parallel(param)):
                    continue
                if for_norm and is_pp_duplicate(param):
                    continue
                at, _, n = piece
                pieces.append((grad[at : at + n], get_tp_spec(param) is not None))
        return pieces

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the gradient partitions so the whole model's ``norm_type``-norm (all TP
        shards, all partitions) is at most ``max_norm``; returns the norm before clipping
        (``inf`` when an fp16 overflow will skip the step)."""
        _check_clip(max_norm, "max_norm")
        norm_type = check_norm_type(norm_type)
        grads, found_inf = self._prepare()
        if found_inf:
            return torch.tensor(float("inf"))
        total = tp_global_norm(
            self._pieces(grads, for_norm=True),
            norm_type,
            self.tp_group,
            dp_group=self.comm.group,
            device=comm_device(self.comm.group),
            pp_group=self.pp_group,
        )
        check_finite_norm(total, norm_type, error_if_nonfinite)
        clip_by_total_norm_(grads, max_norm, total)
        return total
