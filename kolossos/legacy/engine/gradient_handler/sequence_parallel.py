"""``SequenceParallelGradientHandler``: average gradients over ``ParallelMode.SEQUENCE_DP``."""

from __future__ import annotations

from kolossos.cluster.collectives import all_reduce_coalesced
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler
from kolossos.legacy.registry import GRADIENT_HANDLER

__all__ = ["SequenceParallelGradientHandler"]


@GRADIENT_HANDLER.register_module
class SequenceParallelGradientHandler(BaseGradientHandler):
    """Average every gradient over ``gpc``'s ``ParallelMode.SEQUENCE_DP`` group (all ranks of one
    pipeline stage: the sequence-parallel ranks times the data-parallel replicas, which all hold
    the whole model): one flat all-reduce per dtype, nothing when the group has one rank.

    Under ``parallel=dict(tensor=dict(size=N, mode="sequence"))`` each rank's gradient holds the
    contributions of its sequence chunk's loss (the ring backward already routes every other
    chunk's share to the rank that owns the keys and values), so the average is the gradient of
    the mean of the ranks' losses. Select it with
    ``gradient_handler = [dict(type="SequenceParallelGradientHandler")]``; torch DDP is then not
    used.

    Raises:
        RuntimeError: the launch built no ``SEQUENCE_DP`` group (no ``mode='sequence'``).
    """

    def handle_gradient(self) -> None:
        """All-reduce and average the gradients of the model's parameters (a collective)."""
        if not gpc.is_initialized(ParallelMode.SEQUENCE_DP):
            raise RuntimeError(
                "SequenceParallelGradientHandler needs parallel=dict(tensor=dict(size=N, "
                "mode='sequence')) in the launch config; use DataParallelGradientHandler "
                "otherwise."
            )
        size = gpc.get_world_size(ParallelMode.SEQUENCE_DP)
        if size == 1:
            return
        grads = [p.grad for p in self._model.parameters() if p.requires_grad and p.grad is not None]
        for grad in grads:
            grad.div_(size)
        # SYNC POINT: every rank of the stage holds gradients of the same shapes in one order
        all_reduce_coalesced(grads, gpc.get_group(ParallelMode.SEQUENCE_DP))
