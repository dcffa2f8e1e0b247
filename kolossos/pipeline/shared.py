"""Parameters shared between pipeline stages (e.g. a word embedding on the first stage tied to
the LM head on the last): one copy per stage, made equal at registration and kept equal by
summing their gradients over the sharing ranks after every pipeline step (what the
single-process tied parameter receives), so identical optimizer steps follow.

This is the one tied-weight synchronisation of kolossos: the schedules call
:func:`stash_shared_gradients` / :func:`sync_shared_gradients` around every step, and the hybrid
engine registers the parameters its model plans tie across stages here. Gradients are summed in
place, so gradients that are views of a ZeRO flat buffer stay views. For clipping and
checkpoints a shared parameter counts once: the copy of the lowest position owns it
(:func:`is_pp_duplicate` marks the others).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from kolossos.cluster.collectives import all_reduce_coalesced, comm_device
from kolossos.cluster.mesh_math import all_groups
from kolossos.pipeline.stage_manager import PipelineStageManager

__all__ = [
    "PipelineSharedModuleWrapper",
    "is_pp_duplicate",
    "stash_shared_gradients",
    "sync_shared_gradients",
]

_ATTR = "_kolossos_pp_shared"  # set on each registered copy: the wrapper sharing it
_ids = itertools.count()  # creation order, the same on every rank (every rank creates each)


class PipelineSharedModuleWrapper:
    """A set of parameters shared by the pipeline positions ``pipeline_ranks``.

    Every process of the job constructs the wrapper (it creates one process group per pipeline,
    a collective); only the ranks at those positions register their copy. Use one wrapper per
    set of shared parameters; parameters shared inside one stage need none (use the same
    ``nn.Parameter``).

    Args:
        pipeline_ranks: pipeline positions that hold a copy, e.g. ``[0, pp_size - 1]``.
        stage_manager: the pipeline (default: all processes form one pipeline).

    Raises:
        ValueError: fewer than two positions, or one outside the pipeline.

    Example:
        >>> wrapper = PipelineSharedModuleWrapper([0, pp_size - 1])  # doctest: +SKIP
        >>> if first: wrapper.register_module(embedding)  # doctest: +SKIP
        >>> if last: wrapper.register_parameter(head.weight)  # doctest: +SKIP
    """

    def __init__(
        self, pipeline_ranks: Sequence[int], stage_manager: PipelineStageManager | None = None
    ) -> None:
        manager = stage_manager or PipelineStageManager.default()
        positions = sorted(set(pipeline_ranks))
        if len(positions) < 2 or not all(0 <= p < manager.pp_size for p in positions):
            raise ValueError(
                f"pipeline_ranks={list(pipeline_ranks)} must name at least two distinct positions "
                f"in [0, {manager.pp_size}) (a pipeline of {manager.pp_size})."
            )
        self.pipeline_ranks = positions
        self.stage_manager = manager
        self.id = next(_ids)
        self.group: ProcessGroup | None = None
        self.ranks: list[int] = []
        for ranks in _all_pipelines(manager, positions):
            # SYNC POINT: new_group is collective; every process creates every group in order.
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                self.group, self.ranks = group, ranks
        self.params: list[nn.Parameter] = []

    @property
    def owns_copy(self) -> bool:
        """Whether this rank's copy is the one clipping and checkpoints count (the lowest
        position's)."""
        return self.stage_manager.stage == self.pipeline_ranks[0]

    def register_module(self, module: nn.Module) -> None:
        """Share every parameter of ``module`` (in ``module.parameters()`` order)."""
        for p in module.parameters():
            self.register_parameter(p)

    def register_parameter(self, param: nn.Parameter) -> None:
        """Share ``param``: copy the first position's value here, and sum gradients from now on.

        Raises:
            RuntimeError: this rank is not one of the wrapper's positions.
            ValueError: the copies differ in shape between the positions.
        """
        if self.group is None:
            raise RuntimeError(
                f"pipeline position {self.stage_manager.stage} (rank {dist.get_rank()}) is not in "
                f"this wrapper's positions {self.pipeline_ranks}; register only there."
            )
        device = comm_device(self.group)
        # SYNC POINT: every sharing rank registers the same number of parameters, in order.
        shape = torch.tensor([param.numel(), *param.shape[:4], param.dim()], dtype=torch.int64)
        shape = torch.nn.functional.pad(shape, (0, 6 - shape.numel())).to(device)
        shapes = [torch.zeros_like(shape) for _ in self.ranks]
        dist.all_gather(shapes, shape, group=self.group)
        if any(not torch.equal(s, shapes[0]) for s in shapes):
            raise ValueError(
                f"shared parameter #{len(self.params)} has shape {tuple(param.shape)} here but "
                "other sizes on other stages; register matching parameters in the same order."
            )
        with torch.no_grad():
            buf = param.data.to(device)
            dist.broadcast(buf, src=self.ranks[0], group=self.group)
            param.data.copy_(buf)
        setattr(param, _ATTR, self)
        self.params.append(param)

    @torch.no_grad()
    def sync_gradients(self, before: dict[int, torch.Tensor] | None = None) -> None:
        """Sum the registered parameters' gradients over the sharing ranks, in place (missing
        gradients count as zeros). ``before``: gradients accumulated before this step (by ``id``
        of the parameter, see :func:`stash_shared_gradients`); they were summed already, so they
        are added back after the sum instead of being summed again."""
        if self.group is None or not self.params:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_coalesced([p.grad for p in self.params if p.grad is not None], self.group)
        for p in self.params:
            if before and id(p) in before and p.grad is not None:
                p.grad.add_(before[id(p)])


def _all_pipelines(manager: PipelineStageManager, positions: list[int]) -> list[list[int]]:
    """The global ranks at ``positions`` of every pipeline of the mesh."""
    mesh = manager.pg_mesh
    if mesh is None:
        return [positions]
    axis = mesh.axis_index(manager.pipeline_axis)
    return [[line[p] for p in positions] for line in all_groups(mesh.shape, (axis,))]


def shared_wrapper_of(param: torch.Tensor) -> PipelineSharedModuleWrapper | None:
    """The wrapper ``param`` was registered with, if any."""
    wrapper = vars(param).get(_ATTR)
    return wrapper if isinstance(wrapper, PipelineSharedModuleWrapper) else None


def is_pp_duplicate(param: torch.Tensor) -> bool:
    """Whether ``param`` is a shared copy that another pipeline position counts (clipping) and
    saves (checkpoints)."""
    wrapper = shared_wrapper_of(param)
    return wrapper is not None and not wrapper.owns_copy


def _wrappers(modules: Iterable[nn.Module]) -> dict[int, PipelineSharedModuleWrapper]:
    found: dict[int, PipelineSharedModuleWrapper] = {}
    for module in modules:
        for p in module.parameters():
            wrapper = shared_wrapper_of(p)
            if wrapper is not None:
                found[wrapper.id] = wrapper
    return found


@torch.no_grad()
def stash_shared_gradients(modules: Iterable[nn.Module]) -> dict[int, torch.Tensor]:
    """Take the gradients the shared parameters in ``modules`` hold now (already summed by an
    earlier step) out of ``.grad`` (a copy is kept and ``.grad`` zeroed in place), so that the
    next :func:`sync_shared_gradients` sums only this step's contributions (gradient
    accumulation over several steps stays exact)."""
    stash: dict[int, torch.Tensor] = {}
    for wrapper in _wrappers(modules).values():
        for p in wrapper.params:
            if p.grad is not None:
                stash[id(p)] = p.grad.clone()
                p.grad.zero_()
    return stash


def sync_shared_gradients(
    modules: Iterable[nn.Module], before: dict[int, torch.Tensor] | None = None
) -> None:
    """Run :meth:`PipelineSharedModuleWrapper.sync_gradients` for every wrapper whose parameters
    appear in ``modules`` (in creation order, the same on every rank); ``before`` is what
    :func:`stash_shared_gradients` took out before the step."""
    wrappers = _wrappers(modules)
    for key in sorted(wrappers):
        wrappers[key].sync_gradients(before)
