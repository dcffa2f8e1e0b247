"""``DeviceMeshManager``: named :class:`~kolossos.device.device_mesh.DeviceMesh` objects, as
``colossalai.cluster.device_mesh_manager``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.device.device_mesh import DeviceMesh

__all__ = ["DeviceMeshInfo", "DeviceMeshManager", "initialize_device_mesh"]


@dataclass
class DeviceMeshInfo:
    """What a device mesh is made of.

    Args:
        physical_ids: the global ranks of the mesh (e.g. ``[4, 5, 6, 7]`` for the last four of
            eight devices).
        mesh_shape: the logical shape (its product is ``len(physical_ids)``). ``None`` asks
            Colossal-AI to profile the hardware for the best shape, which kolossos does not
            do: :func:`initialize_device_mesh` raises ``NotImplementedError`` for it.

    Raises:
        ValueError: the shape does not hold ``len(physical_ids)`` devices.
    """

    physical_ids: list[int]
    mesh_shape: torch.Size | list[int] | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.mesh_shape is not None and math.prod(self.mesh_shape) != len(self.physical_ids):
            raise ValueError(
                f"DeviceMeshInfo: mesh_shape {tuple(self.mesh_shape)} holds "
                f"{math.prod(self.mesh_shape)} devices but physical_ids has "
                f"{len(self.physical_ids)}; make their sizes agree."
            )


def initialize_device_mesh(device_mesh_info: DeviceMeshInfo) -> DeviceMesh:
    """Build the mesh ``device_mesh_info`` describes, with its process groups (COLLECTIVE over
    the default group).

    Raises:
        NotImplementedError: ``mesh_shape`` is ``None`` (the alpha-beta profiling search).
    """
    if device_mesh_info.mesh_shape is None:
        raise NotImplementedError(
            "DeviceMeshInfo(mesh_shape=None) asks for a hardware-profiling search of the mesh "
            "shape, which kolossos does not implement; pass mesh_shape explicitly, e.g. "
            f"mesh_shape=({len(device_mesh_info.physical_ids)},)."
        )
    physical = torch.tensor(device_mesh_info.physical_ids)
    logical = physical.reshape(tuple(device_mesh_info.mesh_shape))
    return DeviceMesh(physical_mesh_id=physical, logical_mesh_id=logical, init_process_group=True)


class DeviceMeshManager:
    """Creates device meshes and keeps them by name.

    Example:
        >>> manager = DeviceMeshManager()
        >>> mesh = manager.create_device_mesh("2x2", DeviceMeshInfo([0, 1, 2, 3], (2, 2)))
        >>> manager.get("2x2") is mesh
        True
    """

    def __init__(self) -> None:
        self.device_mesh_store: dict[str, DeviceMesh] = {}

    def create_device_mesh(self, name: str, device_mesh_info: DeviceMeshInfo) -> DeviceMesh:
        """Create a mesh (COLLECTIVE: every rank calls it) and store it as ``name``.

        Raises:
            ValueError: a mesh called ``name`` exists already.
        """
        if name in self.device_mesh_store:
            raise ValueError(f"device mesh {name!r} exists already; destroy it or pick a new name.")
        mesh = initialize_device_mesh(device_mesh_info)
        self.device_mesh_store[name] = mesh
        return mesh

    def get(self, name: str) -> DeviceMesh:
        """The mesh called ``name``.

        Raises:
            ValueError: there is none.
        """
        if name not in self.device_mesh_store:
            raise ValueError(
                f"device mesh {name!r} does not exist; have {sorted(self.device_mesh_store)}."
            )
        return self.device_mesh_store[name]

    def destroy(self, name: str) -> None:
        """Destroy the process groups of mesh ``name`` this rank belongs to, and forget it.

        Raises:
            ValueError: there is no mesh called ``name``.
        """
        mesh = self.get(name)
        _destroy_groups(mesh)
        del self.device_mesh_store[name]

    def destroy_all(self) -> None:
        """Destroy every stored mesh's process groups and forget the meshes."""
        for mesh in self.device_mesh_store.values():
            _destroy_groups(mesh)
        self.device_mesh_store.clear()


def _destroy_groups(mesh: DeviceMesh) -> None:
    seen: dict[int, ProcessGroup] = {}
    for groups in mesh.process_groups_dict.values():
        for group in groups.values():
            seen.setdefault(id(group), group)
    for group in seen.values():
        # a handle of a group this rank is not in is NON_GROUP_MEMBER: nothing to destroy
        if group is not dist.GroupMember.NON_GROUP_MEMBER and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
