"""``PipelineSharedModuleWrapper`` (Colossal-AI's ``colossalai.nn.layer.wrapper``): parameters
shared by several pipeline stages of the legacy API (e.g. the word embedding of the first stage
tied to the LM head of the last), laid out by ``gpc``'s PIPELINE groups.

It is kolossos' one tied-weight mechanism (:class:`kolossos.pipeline.PipelineSharedModuleWrapper`)
with its groups built from ``gpc``'s layout instead of a stage manager: registration copies the
first sharing stage's values to the others, and
:class:`~kolossos.legacy.engine.gradient_handler.PipelineSharedModuleGradientHandler` (added by
``kolossos.initialize`` when a model holds such parameters) sums their gradients over the sharing
stages before each optimizer step, so the copies stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
import torch.nn as nn

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.context.process_group_initializer.layouts import pipeline_groups
from kolossos.legacy.core import global_context as gpc
from kolossos.pipeline import shared as _shared

__all__ = ["PipelineSharedModuleWrapper"]

PG_ATTR = "pipeline_shared_module_pg"  # upstream's mark: the group summing the gradient


class PipelineSharedModuleWrapper(_shared.PipelineSharedModuleWrapper):
    """One set of parameters shared by the pipeline stages ``pipeline_ranks``.

    Every process of the job constructs the wrapper, in the same order (creating the process
    group of the sharing stages of every pipeline is collective); then each sharing stage
    registers its copy with :meth:`register_module` / :meth:`register_parameter`, in the same
    order on every sharing stage. Each registered parameter is marked (``param.
    pipeline_shared_module_pg`` is the group, as upstream), which makes ``kolossos.initialize``
    add :class:`PipelineSharedModuleGradientHandler`. One wrapper per set of shared parameters;
    parameters shared inside one stage need none.

    Args:
        pipeline_ranks: the pipeline ranks (stages, ``gpc.get_local_rank(ParallelMode.PIPELINE)``)
            holding a copy, e.g. ``[0, pipeline_size - 1]``.

    Raises:
        ValueError: fewer than two distinct stages, or a stage outside the pipeline (before any
            collective).

    Example:
        >>> last = gpc.pipeline_parallel_size - 1  # doctest: +SKIP
        >>> wrapper = PipelineSharedModuleWrapper([0, last])  # doctest: +SKIP
        >>> if gpc.is_first_rank(ParallelMode.PIPELINE):  # doctest: +SKIP
        ...     wrapper.register_module(model.embed)
        >>> if gpc.is_last_rank(ParallelMode.PIPELINE):  # doctest: +SKIP
        ...     wrapper.register_parameter(model.head.weight)
    """

    def __init__(self, pipeline_ranks: Sequence[int]) -> None:
        # The runtime's wrapper takes its layout from a stage manager; the legacy one takes it
        # from gpc, so the attributes its methods use are filled here.
        pp_size = gpc.pipeline_parallel_size if gpc.is_initialized(ParallelMode.PIPELINE) else 1
        positions = sorted(set(pipeline_ranks))
        if len(positions) < 2 or not all(0 <= p < pp_size for p in positions):
            raise ValueError(
                f"pipeline_ranks={list(pipeline_ranks)} must name at least two distinct pipeline "
                f"stages in [0, {pp_size}) (parallel.pipeline={pp_size}); e.g. [0, {pp_size - 1}] "
                "for an embedding tied to the LM head."
            )
        self.pipeline_ranks = positions
        self.id = next(_shared._ids)
        self.group: dist.ProcessGroup | None = None
        self.ranks: list[int] = []
        self.params: list[nn.Parameter] = []
        self._stage = gpc.get_local_rank(ParallelMode.PIPELINE)
        world = gpc.get_world_size(ParallelMode.GLOBAL)
        data = gpc.get_world_size(ParallelMode.DATA)
        for line in pipeline_groups(world, data, pp_size):
            ranks = [line[p] for p in positions]
            # SYNC POINT: new_group is collective; every process creates every group in order.
            group = dist.new_group(ranks)
            if gpc.get_global_rank() in ranks:
                self.group, self.ranks = group, ranks

    @property
    def ranks_in_group(self) -> list[int] | None:
        """Upstream's name: the global ranks sharing the parameters (``None`` off them)."""
        return self.ranks or None

    @property
    def owns_copy(self) -> bool:
        """Whether this stage's copy is the one clipping and checkpoints count (the lowest
        sharing stage's)."""
        return self._stage == self.pipeline_ranks[0]

    def register_parameter(self, param: nn.Parameter) -> None:
        """Share ``param``: take the first sharing stage's value, mark it for the gradient handler.

        Raises:
            RuntimeError: this rank's stage is not one of ``pipeline_ranks``.
            ValueError: the copies differ in shape between the stages.
        """
        if self.group is None:
            raise RuntimeError(
                f"pipeline stage {self._stage} (global rank {gpc.get_global_rank()}) is not in "
                f"this wrapper's pipeline_ranks {self.pipeline_ranks}; register only there."
            )
        super().register_parameter(param)  # SYNC POINT: shape check and broadcast in the group
        setattr(param, PG_ATTR, self.group)

    def register_module(self, module: nn.Module) -> None:
        """Share every parameter of ``module`` (in ``module.parameters()`` order)."""
        for p in module.parameters():
            self.register_parameter(p)
