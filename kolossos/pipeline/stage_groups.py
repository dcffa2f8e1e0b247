"""Process groups over pipeline positions: the two-rank group of each pair of neighbouring
stages (Colossal-AI's ``get_p2p_process_group``) and groups of chosen stages
(``init_process_group_by_stages``).

Creating a group is collective: every process of the job creates every pipeline's group, in the
same order, even the pipelines it is not part of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.cluster import mesh_math

__all__ = ["neighbour_pairs", "new_stage_groups", "pipelines_of"]


def pipelines_of(pg_mesh: Any, pipeline_axis: int | str) -> list[list[int]]:
    """The global ranks of every pipeline of ``pg_mesh`` along ``pipeline_axis``, each by
    pipeline position (the same list on every rank)."""
    axis = pg_mesh.axis_index(pipeline_axis)
    return mesh_math.all_groups(pg_mesh.shape, (axis,))


def neighbour_pairs(pp_size: int, wrap: bool) -> list[tuple[int, int]]:
    """Pairs of pipeline positions that exchange messages: each position and the next, plus
    ``(0, pp_size - 1)`` when ``wrap`` (the last stage feeds the first, as in interleaved 1F1B)."""
    pairs = [(i, i + 1) for i in range(pp_size - 1)]
    if wrap and pp_size > 2:
        pairs.append((0, pp_size - 1))
    return pairs


def new_stage_groups(pipelines: list[list[int]], stages: Sequence[int]) -> ProcessGroup | None:
    """Create, for every pipeline, the group of its ranks at pipeline positions ``stages``;
    return this rank's (``None`` when its position is not among ``stages``).

    Collective: every process of the job calls it with the same arguments, in the same order.
    """
    # SYNC POINT: new_group is collective over the whole job.
    group, _ = dist.new_subgroups_by_enumeration([[p[s] for s in stages] for p in pipelines])
    return group
