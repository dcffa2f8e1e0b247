"""``Layout``: a global tensor shape, a device mesh and a sharding spec together — where every
piece of a distributed tensor lives.

Example:
    >>> from kolossos.device.device_mesh import DeviceMesh
    >>> mesh = DeviceMesh(torch.arange(4), (2, 2))
    >>> layout = Layout(mesh, ShardingSpec.from_notation("S01R"), (8, 4))
    >>> layout.local_shape
    (2, 4)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from kolossos.device.device_mesh import DeviceMesh
from kolossos.tensor.sharding_spec import ShardingSpec

__all__ = ["Layout"]


class Layout:
    """The placement of a ``global_shape`` tensor cut by ``sharding_spec`` over ``device_mesh``.

    Args:
        device_mesh: the logical mesh (its ``shape`` gives the axis sizes).
        sharding_spec: how each tensor dimension is cut.
        global_shape: the shape of the whole tensor.

    Raises:
        ValueError: a spec for another number of dimensions, a mesh axis the mesh lacks, or a
            dimension not divisible by the number of pieces it is cut into.
    """

    def __init__(
        self, device_mesh: DeviceMesh, sharding_spec: ShardingSpec, global_shape: Sequence[int]
    ) -> None:
        self.device_mesh = device_mesh
        self.sharding_spec = sharding_spec
        self.global_shape = torch.Size(global_shape)
        mesh_shape = tuple(device_mesh.shape)
        if sharding_spec.dims != len(self.global_shape):
            raise ValueError(
                f"sharding spec {sharding_spec} has {sharding_spec.dims} dimensions but the "
                f"tensor shape {tuple(self.global_shape)} has {len(self.global_shape)}."
            )
        for dim, axes in sharding_spec.dim_partition_dict.items():
            if any(a >= len(mesh_shape) for a in axes):
                raise ValueError(
                    f"sharding spec {sharding_spec} uses mesh axes {axes} but the mesh "
                    f"{mesh_shape} has {len(mesh_shape)} axes."
                )
            pieces = math.prod(mesh_shape[a] for a in axes)
            if self.global_shape[dim] % pieces:
                raise ValueError(
                    f"{sharding_spec} cuts dimension {dim} (size {self.global_shape[dim]}) into "
                    f"{pieces} pieces; choose a spec or shape where the pieces divide the size."
                )

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of every rank's piece."""
        mesh_shape = tuple(self.device_mesh.shape)
        return tuple(
            size // math.prod(mesh_shape[a] for a in self.sharding_spec.axes_of(d))
            for d, size in enumerate(self.global_shape)
        )

    def placements(self) -> list[Placement]:
        """The equivalent DTensor placements, one per mesh axis.

        Raises:
            NotImplementedError: a dimension cut by mesh axes in decreasing order (``S10``),
                which DTensor's nesting (outer mesh axis first) cannot express.
        """
        out: list[Placement] = [Replicate() for _ in tuple(self.device_mesh.shape)]
        for dim, axes in self.sharding_spec.dim_partition_dict.items():
            if list(axes) != sorted(axes):
                raise NotImplementedError(
                    f"{self.sharding_spec}: dimension {dim} is cut by mesh axes {axes} in "
                    "decreasing order; use increasing order (S01, not S10)."
                )
            for axis in axes:
                out[axis] = Shard(dim)
        return out

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Layout)
            and self.device_mesh is other.device_mesh
            and self.sharding_spec == other.sharding_spec
            and self.global_shape == other.global_shape
        )

    def __hash__(self) -> int:
        return hash((id(self.device_mesh), self.sharding_spec, tuple(self.global_shape)))

    def __repr__(self) -> str:
        return f"Layout({self.sharding_spec} of {tuple(self.global_shape)} on {self.device_mesh})"
