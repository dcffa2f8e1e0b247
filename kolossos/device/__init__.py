"""Logical device meshes: :class:`~kolossos.device.device_mesh.DeviceMesh` (as
``colossalai.device.device_mesh``).

Example:
    >>> import torch
    >>> from kolossos.device.device_mesh import DeviceMesh
    >>> DeviceMesh(torch.arange(4), (2, 2)).global_rank_to_local_rank(2)
    [1, 0]
"""

from kolossos.device.device_mesh import DeviceMesh

__all__ = ["DeviceMesh"]
