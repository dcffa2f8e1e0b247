"""Cluster layout: :class:`ProcessGroupMesh`, :class:`DistCoordinator` and
:class:`DeviceMeshManager`."""

from kolossos.cluster.device_mesh_manager import DeviceMeshInfo, DeviceMeshManager
from kolossos.cluster.dist_coordinator import DistCoordinator, priority_execution
from kolossos.cluster.process_group_mesh import ProcessGroupMesh

__all__ = [
    "DeviceMeshInfo",
    "DeviceMeshManager",
    "DistCoordinator",
    "ProcessGroupMesh",
    "priority_execution",
]
