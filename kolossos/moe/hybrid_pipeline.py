"""Expert parallelism inside the hybrid mesh, pipeline stages included.

* :func:`create_mesh_moe_groups`: the expert-parallel groups are carved out of each
  data-parallel group of the mesh (one per pipeline position): blocks of ``ep_size``
  consecutive data-parallel ranks hold one copy of the experts, the ranks at the same place of
  every block form an expert's data-parallel group (``ep x moe_dp = dp`` per stage). With
  ``pp = tp = 1`` this is :func:`~kolossos.moe.parallel_info.create_moe_groups`'s layout.
* :class:`MoePipelineRuntime`: the hybrid pipeline runtime whose data-parallel average after a
  step skips the experts (:class:`~kolossos.moe.hybrid_optimizer.MoeDDPOptimizer` reduces them
  over their expert DP group before the step); with ZeRO the schedule's backwards go through
  both reducers (:meth:`~kolossos.moe.hybrid_optimizer.MoeZeroOptimizer.pipeline_backward_plan`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from kolossos.hybrid.mesh import DP, HybridMesh
from kolossos.hybrid.pipeline_runtime import PipelineRuntime
from kolossos.interface import OptimizerWrapper
from kolossos.moe.hybrid_optimizer import MoeZeroOptimizer
from kolossos.moe.parallel_info import MoeParallelInfo, moe_group_ranks
from kolossos.moe.params import is_moe_param

__all__ = ["MoePipelineRuntime", "create_mesh_moe_groups", "mesh_dp_ranks"]


def mesh_dp_ranks(shape: Sequence[int], names: Sequence[str], dp_axis: str = DP) -> list[list[int]]:
    """The ranks of every data-parallel group of a row-major mesh (pure), ordered by the
    coordinates of the other axes.

    Example:
        >>> mesh_dp_ranks((2, 2, 1), ("dp", "pp", "tp"))  # (dp, pp, tp): rank = 2 dp + pp
        [[0, 2], [1, 3]]
    """
    axis = list(names).index(dp_axis)
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    others = [range(n) if i != axis else range(1) for i, n in enumerate(shape)]
    groups = []
    for coord in itertools.product(*others):
        base = sum(c * s for c, s in zip(coord, strides, strict=True))
        groups.append([base + d * strides[axis] for d in range(shape[axis])])
    return groups


def _group(ranks: list[int]) -> dist.ProcessGroup | None:
    if len(ranks) == 1:
        return None
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(ranks)  # SYNC POINT: every rank creates every group


def create_mesh_moe_groups(mesh: HybridMesh, ep_size: int) -> MoeParallelInfo:
    """This rank's expert-parallel layout inside its data-parallel group (module doc).

    COLLECTIVE over the world: every rank creates every group, in the same order.

    Raises:
        ValueError: ``ep_size`` does not divide the data-parallel size.
    """
    pg_mesh = mesh.mesh
    rank = dist.get_rank()
    mine: dict[str, tuple[list[int], dist.ProcessGroup | None]] = {}
    for dp_ranks in mesh_dp_ranks(pg_mesh.shape, pg_mesh.axis_names):
        ep_local, dp_local = moe_group_ranks(len(dp_ranks), ep_size)
        for kind, local_groups in (("ep", ep_local), ("dp", dp_local)):
            for local in local_groups:
                ranks = [dp_ranks[i] for i in local]
                group = _group(ranks)
                if rank in ranks:
                    mine[kind] = (ranks, group)
    (ep_ranks, ep_group), (dp_ranks_, dp_group) = mine["ep"], mine["dp"]
    return MoeParallelInfo(
        ep_size=len(ep_ranks),
        ep_rank=ep_ranks.index(rank),
        ep_group=ep_group,
        dp_size=len(dp_ranks_),
        dp_group=dp_group,
    )


class MoePipelineRuntime(PipelineRuntime):
    """The hybrid pipeline runtime for expert-parallel stages (module doc)."""

    @torch.no_grad()
    def average_dp_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Average the dense gradients over the data-parallel group; experts are left to the
        optimizer (summed over their expert DP group, divided by ``dp``)."""
        super().average_dp_grads([p for p in params if not is_moe_param(p)])

    def backward_plan(
        self, optimizer: OptimizerWrapper | None
    ) -> tuple[float, AbstractContextManager[Any], Any]:
        """The dense and expert ZeRO optimizers' plan, else the hybrid runtime's."""
        if isinstance(optimizer, MoeZeroOptimizer):
            return optimizer.pipeline_backward_plan()
        return super().backward_plan(optimizer)
