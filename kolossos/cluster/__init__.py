"""Cluster layout: :class:`ProcessGroupMesh` and :class:`DistCoordinator`."""

from kolossos.cluster.dist_coordinator import DistCoordinator, priority_execution
from kolossos.cluster.process_group_mesh import ProcessGroupMesh

__all__ = ["DistCoordinator", "ProcessGroupMesh", "priority_execution"]
