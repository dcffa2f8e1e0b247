"""``DataParallelGradientHandler``: average gradients over the global context's DATA group."""

from __future__ import annotations

from kolossos.cluster.collectives import all_reduce_coalesced
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler
from kolossos.legacy.registry import GRADIENT_HANDLER

__all__ = ["DataParallelGradientHandler"]


@GRADIENT_HANDLER.register_module
class DataParallelGradientHandler(BaseGradientHandler):
    """Average every gradient over ``gpc``'s ``ParallelMode.DATA`` group: one flat all-reduce per
    dtype (a collective; nothing happens when the data-parallel size is 1).

    Select it with ``gradient_handler = [dict(type="DataParallelGradientHandler")]``; torch DDP
    is then not used.
    """

    def handle_gradient(self) -> None:
        """All-reduce and average the gradients of the model's parameters."""
        size = gpc.get_world_size(ParallelMode.DATA)
        if size == 1:
            return
        grads = [p.grad for p in self._model.parameters() if p.requires_grad and p.grad is not None]
        for grad in grads:
            grad.div_(size)
        # SYNC POINT: every data-parallel rank holds gradients of the same shapes in one order
        all_reduce_coalesced(grads, gpc.get_group(ParallelMode.DATA))
