"""The (dp, pp, tp) process mesh of :class:`HybridParallelPlugin` and its groups.

The tensor-parallel axis is always the last (fastest-varying) one, so the ranks of one TP group
are consecutive, which keeps the chattiest collectives inside a node. ``dp_outside`` chooses
between ``(dp, pp, tp)`` (default) and ``(pp, dp, tp)``.

With a sequence-parallel axis (``sp_size > 1``, modes ``'all_to_all'`` / ``'ring_attn'``) the
mesh has four axes, laid out as Colossal-AI v0.4 does: ``(dp, pp, tp, sp)`` for Ulysses (the SP
ranks innermost) and ``(dp, pp, sp, tp)`` for ring attention (TP innermost); ``(pp, dp, ...)``
with ``dp_outside=False``. The SP ranks hold replicas of the weights and see the same samples,
so the data loader shards over ``dp`` only while gradients are reduced over ``dp x sp``
(:attr:`HybridMesh.grad_group`, Colossal-AI's ``mixed_dp_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.cluster import ProcessGroupMesh

__all__ = ["HybridMesh", "build_mesh", "mesh_layout"]

DP, PP, TP, SP = "dp", "pp", "tp", "sp"


def mesh_layout(
    dp_size: int,
    pp_size: int,
    tp_size: int,
    dp_outside: bool = True,
    sp_size: int = 1,
    sp_inner: bool = True,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh shape and axis names (pure; no process group). ``sp_size > 1`` adds the
    sequence-parallel axis, innermost (``sp_inner``, Ulysses) or just outside TP (ring).

    Example:
        >>> mesh_layout(2, 1, 2)
        ((2, 1, 2), ('dp', 'pp', 'tp'))
        >>> mesh_layout(2, 3, 4, dp_outside=False)
        ((3, 2, 4), ('pp', 'dp', 'tp'))
        >>> mesh_layout(1, 1, 2, sp_size=2, sp_inner=False)
        ((1, 1, 2, 2), ('dp', 'pp', 'sp', 'tp'))
    """
    outer = ((dp_size, DP), (pp_size, PP)) if dp_outside else ((pp_size, PP), (dp_size, DP))
    inner: tuple[tuple[int, str], ...] = ((tp_size, TP),)
    if sp_size > 1:
        inner = ((tp_size, TP), (sp_size, SP)) if sp_inner else ((sp_size, SP), (tp_size, TP))
    axes = (*outer, *inner)
    return tuple(n for n, _ in axes), tuple(a for _, a in axes)


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
    sp_group: ProcessGroup | None = None
    """Ranks sharing one sequence (``'all_to_all'`` / ``'ring_attn'``); ``None`` without."""
    grad_group: ProcessGroup | None = None
    """Ranks holding replicas whose gradients are averaged: ``dp x sp`` (``dp_group`` when
    there is no SP axis). DDP, ZeRO and the checkpoint IO use it."""

    @property
    def replica_group(self) -> ProcessGroup:
        """:attr:`grad_group`, or :attr:`dp_group` without an SP axis."""
        return self.grad_group if self.grad_group is not None else self.dp_group

    @property
    def sp_size(self) -> int:
        """Sequence-parallel size (1 without an SP axis)."""
        return dist.get_world_size(self.sp_group) if self.sp_group is not None else 1

    @property
    def replica_size(self) -> int:
        """Size of :attr:`replica_group` (``dp_size x sp_size``)."""
        return dist.get_world_size(self.replica_group)

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


def build_mesh(
    dp_size: int,
    pp_size: int,
    tp_size: int,
    dp_outside: bool = True,
    sp_size: int = 1,
    sp_inner: bool = True,
) -> HybridMesh:
    """Build the mesh and its per-axis groups (a collective: every rank calls it, in order).

    Raises:
        ValueError: the sizes do not multiply to the world size.
    """
    shape, names = mesh_layout(dp_size, pp_size, tp_size, dp_outside, sp_size, sp_inner)
    mesh = ProcessGroupMesh(*shape, axis_names=names)
    groups = {axis: mesh.get_group_along_axis(axis) for axis in (DP, PP, TP)}
    assert dist.get_world_size(groups[TP]) == tp_size
    if sp_size == 1:
        return HybridMesh(mesh, groups[DP], groups[PP], groups[TP])
    sp_group = mesh.get_group_along_axis(SP)
    grad_group = mesh.get_group_along_axis((DP, SP))
    return HybridMesh(mesh, groups[DP], groups[PP], groups[TP], sp_group, grad_group)
