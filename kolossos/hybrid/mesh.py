"""The (dp, pp, tp) process mesh of :class:`HybridParallelPlugin` and its groups.

The tensor-parallel axis is always the last (fastest-varying) one, so the ranks of one TP group
are consecutive, which keeps the chattiest collectives inside a node. ``dp_outside`` chooses
between ``(dp, pp, tp)`` (default) and ``(pp, dp, tp)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.cluster import ProcessGroupMesh

__all__ = ["HybridMesh", "build_mesh", "mesh_layout"]

DP, PP, TP = "dp", "pp", "tp"


def mesh_layout(
    dp_size: int, pp_size: int, tp_size: int, dp_outside: bool = True
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh shape and axis names (pure; no process group).

    Example:
        >>> mesh_layout(2, 1, 2)
        ((2, 1, 2), ('dp', 'pp', 'tp'))
        >>> mesh_layout(2, 3, 4, dp_outside=False)
        ((3, 2, 4), ('pp', 'dp', 'tp'))
    """
    if dp_outside:
        return (dp_size, pp_size, tp_size), (DP, PP, TP)
    return (pp_size, dp_size, tp_size), (PP, DP, TP)


@dataclass(frozen=True, eq=False)
class HybridMesh:
    """The process mesh and this rank's groups and coordinates on it."""

    mesh: ProcessGroupMesh
    """The underlying mesh (its ``device_mesh`` serves DTensor code)."""
    dp_group: ProcessGroup
    """Ranks holding the same model shard (data parallelism)."""
    pp_group: ProcessGroup
    """Ranks holding the stages of one pipeline."""
    tp_group: ProcessGroup
    """Ranks sharing one layer's tensors (tensor parallelism; also split-gather SP)."""

    @property
    def dp_size(self) -> int:
        """Data-parallel size."""
        return int(self.mesh.size(DP))  # type: ignore[arg-type]

    @property
    def pp_size(self) -> int:
        """Pipeline size."""
        return int(self.mesh.size(PP))  # type: ignore[arg-type]

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return int(self.mesh.size(TP))  # type: ignore[arg-type]

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate."""
        return int(self.mesh.coordinate(DP))  # type: ignore[arg-type]

    @property
    def tp_rank(self) -> int:
        """This rank's tensor-parallel coordinate."""
        return int(self.mesh.coordinate(TP))  # type: ignore[arg-type]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline coordinate."""
        return int(self.mesh.coordinate(PP))  # type: ignore[arg-type]


def build_mesh(dp_size: int, pp_size: int, tp_size: int, dp_outside: bool = True) -> HybridMesh:
    """Build the mesh and its per-axis groups (a collective: every rank calls it, in order).

    Raises:
        ValueError: the sizes do not multiply to the world size.
    """
    shape, names = mesh_layout(dp_size, pp_size, tp_size, dp_outside)
    mesh = ProcessGroupMesh(*shape, axis_names=names)
    groups = {axis: mesh.get_group_along_axis(axis) for axis in (DP, PP, TP)}
    assert dist.get_world_size(groups[TP]) == tp_size
    return HybridMesh(mesh, groups[DP], groups[PP], groups[TP])
