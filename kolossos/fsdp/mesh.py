"""The ``DeviceMesh`` FSDP2 shards over, built from the sharding strategy and process group(s).

* ``FULL_SHARD`` / ``SHARD_GRAD_OP``: a 1-D mesh over the process group (default: the world).
* ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: a 2-D ``(replicate, shard)`` mesh. From FSDP1's
  ``(shard_group, replicate_group)`` pair, or by default sharding within each node
  (``LOCAL_WORLD_SIZE`` processes, as set by torchrun and ``kolossos run``) and replicating
  across nodes. The explicit mesh matters: classic FSDP's HYBRID_SHARD silently trains wrong on
  gloo without one.
* ``NO_SHARD``: a 2-D mesh whose shard dimension has size 1 (every rank holds everything;
  gradients are all-reduced over the replicate dimension).

Building a mesh creates process groups: every rank of the world calls it, in the same order.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kolossos.fsdp.config import TorchFSDPConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIM_NAMES", "build_mesh", "data_parallel_group"]

#: dimension names of the 2-D (hybrid) meshes this module builds
MESH_DIM_NAMES = ("replicate", "shard")


def _node_size(world: int) -> int:
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    size = int(raw) if raw.isdigit() and int(raw) > 0 else world
    if world % size:
        raise ValueError(
            f"HYBRID_SHARD shards within a node of LOCAL_WORLD_SIZE={size} processes, which "
            f"does not divide the world size {world}; pass process_group=(shard_group, "
            "replicate_group) or a 2-D device_mesh."
        )
    return size


def _from_group_pair(shard: dist.ProcessGroup, replicate: dist.ProcessGroup, device: str) -> Any:
    """A ``(replicate, shard)`` mesh from FSDP1's pair of groups (a collective over ``replicate``).

    Row ``i`` of the mesh is the shard group of the ``i``-th member of this rank's replicate
    group; gathering the shard groups along the replicate group yields exactly those rows.
    """
    from torch.distributed.device_mesh import DeviceMesh

    mine = dist.get_process_group_ranks(shard)
    rows: list[Any] = [None] * dist.get_world_size(replicate)
    dist.all_gather_object(rows, mine, group=replicate)  # sync point (replicate group)
    if any(len(r) != len(mine) for r in rows):
        raise ValueError("process_group=(shard_group, replicate_group): shard groups differ.")
    layout = torch.tensor(rows, dtype=torch.int64)
    if sorted(layout[:, dist.get_group_rank(shard, dist.get_rank())].tolist()) != sorted(
        dist.get_process_group_ranks(replicate)
    ):
        raise ValueError(
            "process_group=(shard_group, replicate_group) do not form a grid: the replicate "
            "group must hold one rank at the same position of each shard group."
        )
    return DeviceMesh.from_group(
        [replicate, shard], device, mesh=layout, mesh_dim_names=MESH_DIM_NAMES
    )


def _no_shard_mesh(group: dist.ProcessGroup | None, device: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is None:
        return init_device_mesh(device, (dist.get_world_size(), 1), mesh_dim_names=MESH_DIM_NAMES)
    ranks = dist.get_process_group_ranks(group)
    # Only this rank belongs to its shard "group": no other rank needs to take part in creating it.
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    layout = torch.tensor(ranks, dtype=torch.int64).view(-1, 1)
    return DeviceMesh.from_group([group, alone], device, mesh=layout, mesh_dim_names=MESH_DIM_NAMES)


def _check_given(mesh: Any, config: TorchFSDPConfig) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh={mesh!r} must be a torch.distributed.DeviceMesh.")
    want = 2 if config.hybrid else 1
    if mesh.ndim != want:
        raise ValueError(
            f"sharding_strategy={config.sharding} needs a {want}-D device_mesh "
            f"({'(replicate, shard)' if want == 2 else '(shard,)'}), got {mesh.ndim}-D."
        )
    if want == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            "a 2-D device_mesh needs mesh_dim_names (FSDP2 requires them for HSDP), e.g. "
            "init_device_mesh(device, (replicate, shard), mesh_dim_names=('replicate', 'shard'))."
        )
    if config.sharding == "NO_SHARD" and mesh.size(1) != 1:
        raise ValueError("NO_SHARD needs a device_mesh whose shard dimension (dim 1) has size 1.")
    return mesh


def build_mesh(config: TorchFSDPConfig, device_type: str) -> DeviceMesh:
    """The mesh for ``config`` (collective: every rank calls it)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    group = config.process_group
    if config.device_mesh is not None:
        return _check_given(config.device_mesh, config)
    if config.sharding == "NO_SHARD":
        return _no_shard_mesh(group, device_type)
    if not config.hybrid:
        if group is None:
            return init_device_mesh(device_type, (dist.get_world_size(),))
        return DeviceMesh.from_group(group, device_type)
    if isinstance(group, tuple):
        return _from_group_pair(group[0], group[1], device_type)
    world = dist.get_world_size()
    shard = _node_size(world)
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=MESH_DIM_NAMES)


def data_parallel_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of every rank in ``mesh`` (``None`` when that is the world): the data-parallel
    ranks, which split the data and agree on overflows."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    if len(ranks) == dist.get_world_size():
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size(1) == 1:
        return mesh.get_group(0)
    return dist.new_group(ranks, use_local_synchronization=True)
