"""``PipelineSharedModuleGradientHandler``: sum the gradients of parameters shared by several
pipeline stages (``PipelineSharedModuleWrapper``) over the stages sharing them."""

from __future__ import annotations

from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler
from kolossos.legacy.registry import GRADIENT_HANDLER
from kolossos.pipeline.shared import PipelineSharedModuleWrapper, shared_wrapper_of

__all__ = ["PipelineSharedModuleGradientHandler"]


@GRADIENT_HANDLER.register_module
class PipelineSharedModuleGradientHandler(BaseGradientHandler):
    """For every set of shared parameters in the model (registered with
    :class:`kolossos.legacy.nn.PipelineSharedModuleWrapper`), all-reduce (sum) their gradients
    over the sharing stages, one flat all-reduce per set and dtype: each copy then holds the
    gradient the single tied parameter would get, and the copies stay equal after the step.

    ``kolossos.initialize`` adds it when the model holds shared parameters; it may also be named
    in the config: ``gradient_handler = [dict(type="PipelineSharedModuleGradientHandler")]``.
    A parameter without a gradient counts as zeros (the sharing stages must agree on sizes).
    """

    def handle_gradient(self) -> None:
        """Sum the shared parameters' gradients over their stages (a collective per set)."""
        wrappers: dict[int, PipelineSharedModuleWrapper] = {}
        for p in self._model.parameters():
            wrapper = shared_wrapper_of(p)
            if wrapper is not None:
                wrappers[wrapper.id] = wrapper
        for key in sorted(wrappers):  # creation order: the same on every sharing rank
            wrappers[key].sync_gradients()  # SYNC POINT
