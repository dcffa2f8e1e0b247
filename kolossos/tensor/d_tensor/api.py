"""Colossal-AI's ``colossalai.tensor.d_tensor`` functions over kolossos' ColoTensor (a DTensor).

A distributed tensor here is a :class:`~kolossos.tensor.ColoTensor` made by
:func:`distribute_tensor` on a :class:`kolossos.device.device_mesh.DeviceMesh`: its ``shape`` is
global, ``to_local()`` is this rank's piece (Colossal-AI returned the piece itself, with the
layout attached).

Example:
    >>> mesh = DeviceMesh(torch.arange(4), (2, 2), init_process_group=True)  # doctest: +SKIP
    >>> spec = ShardingSpec(2, {0: [0, 1]})
    >>> t = distribute_tensor(torch.randn(4, 4), mesh, spec)  # doctest: +SKIP
    >>> t.to_local().shape, to_global(t).shape  # doctest: +SKIP
    (torch.Size([1, 4]), torch.Size([4, 4]))
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import distribute_tensor as _dtensor_distribute

from kolossos.device.device_mesh import DeviceMesh
from kolossos.tensor.colo_tensor import ColoTensor
from kolossos.tensor.d_tensor.layout import Layout
from kolossos.tensor.d_tensor.layout_converter import LayoutConverter
from kolossos.tensor.sharding_spec import ShardingSpec

__all__ = [
    "compute_global_numel",
    "distribute_tensor",
    "get_device_mesh",
    "get_global_shape",
    "get_layout",
    "get_sharding_spec",
    "is_distributed_tensor",
    "is_sharded",
    "redistribute",
    "shard_colwise",
    "shard_rowwise",
    "sharded_tensor_to_param",
    "to_global",
]

_CONVERTER = LayoutConverter()


class _LayoutTensor(ColoTensor):
    """A ColoTensor that remembers its kolossos mesh and sharding spec."""

    dist_layout: Layout


def _as_layout_tensor(dt: DTensor, layout: Layout) -> _LayoutTensor:
    out = _LayoutTensor._wrap(dt._local_tensor, dt, requires_grad=dt.requires_grad)
    out.dist_layout = layout
    return out


def is_distributed_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was made by :func:`distribute_tensor` (or :func:`redistribute`)."""
    return isinstance(tensor, _LayoutTensor)


def get_layout(tensor: torch.Tensor) -> Layout:
    """The :class:`Layout` of a distributed tensor.

    Raises:
        TypeError: ``tensor`` is not one.
    """
    if not isinstance(tensor, _LayoutTensor):
        raise TypeError(
            f"{type(tensor).__name__} is not a distributed tensor; make one with "
            "kolossos.tensor.d_tensor.distribute_tensor(tensor, device_mesh, sharding_spec)."
        )
    return tensor.dist_layout


def get_sharding_spec(tensor: torch.Tensor) -> ShardingSpec:
    """The sharding spec of a distributed tensor."""
    return get_layout(tensor).sharding_spec


def get_device_mesh(tensor: torch.Tensor) -> DeviceMesh:
    """The kolossos device mesh of a distributed tensor."""
    return get_layout(tensor).device_mesh


def get_global_shape(tensor: torch.Tensor) -> torch.Size:
    """The global shape of a distributed tensor."""
    return get_layout(tensor).global_shape


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether a distributed tensor is cut along some dimension."""
    return not get_sharding_spec(tensor).is_replicated()


def distribute_tensor(
    tensor: torch.Tensor, device_mesh: DeviceMesh, sharding_spec: ShardingSpec
) -> ColoTensor:
    """Cut the whole ``tensor`` (the same on every rank) by ``sharding_spec`` over
    ``device_mesh``; COLLECTIVE on the first use of the mesh (it makes its torch mesh).

    Raises:
        ValueError: the spec does not fit the tensor or the mesh.
    """
    layout = Layout(device_mesh, sharding_spec, tensor.shape)
    dt = _dtensor_distribute(tensor.detach(), device_mesh.get_torch_mesh(), layout.placements())
    out = _as_layout_tensor(dt, layout)
    out.requires_grad_(tensor.requires_grad)
    return out


def redistribute(
    tensor: torch.Tensor, device_mesh: DeviceMesh, sharding_spec: ShardingSpec
) -> ColoTensor:
    """``tensor`` in a new sharding, by the layout converter's path. Like Colossal-AI, the
    tensor itself is updated in place (and returned); a tensor inside an autograd graph (not a
    leaf, needing a gradient) is left alone and the differentiable result returned instead.

    Raises:
        TypeError: ``tensor`` is not a distributed tensor.
        ValueError: ``device_mesh`` is not the tensor's mesh.
    """
    source = get_layout(tensor)
    assert isinstance(tensor, _LayoutTensor)
    if device_mesh is not source.device_mesh:
        raise ValueError(
            "redistribute: device_mesh must be the tensor's own mesh (get_device_mesh)."
        )
    target = Layout(device_mesh, sharding_spec, source.global_shape)
    in_graph = tensor.requires_grad and not tensor.is_leaf and torch.is_grad_enabled()
    local = tensor.to_local() if in_graph else tensor.to_local().detach()
    plain = DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False)
    if in_graph:
        return _as_layout_tensor(_CONVERTER.apply(plain, source, target), target)
    with torch.no_grad():
        moved = _CONVERTER.apply(plain, source, target)
    tensor._swap(moved)
    tensor.dist_layout = target
    return tensor


def compute_global_numel(tensor: torch.Tensor) -> int:
    """The number of elements of the global tensor."""
    return math.prod(get_global_shape(tensor))


def _one_dim_mesh(group_or_device_mesh: dist.ProcessGroup | DeviceMesh | None) -> DeviceMesh:
    if isinstance(group_or_device_mesh, DeviceMesh):
        if len(tuple(group_or_device_mesh.shape)) != 1:
            raise ValueError(
                f"shard_rowwise/shard_colwise need a 1-d mesh, got {group_or_device_mesh}; "
                "use distribute_tensor for an N-d mesh."
            )
        return group_or_device_mesh
    group = group_or_device_mesh if group_or_device_mesh is not None else dist.group.WORLD
    assert group is not None
    return DeviceMesh.from_process_group(group)


def shard_rowwise(
    tensor: torch.Tensor, group_or_device_mesh: dist.ProcessGroup | DeviceMesh | None = None
) -> ColoTensor:
    """Cut dimension 0 of the whole ``tensor`` over a group (default: all ranks) or a 1-d mesh
    (COLLECTIVE on the first use of the group: it makes a torch mesh)."""
    return distribute_tensor(
        tensor, _one_dim_mesh(group_or_device_mesh), ShardingSpec(tensor.dim(), {0: [0]})
    )


def shard_colwise(
    tensor: torch.Tensor, group_or_device_mesh: dist.ProcessGroup | DeviceMesh | None = None
) -> ColoTensor:
    """Cut the last dimension of the whole ``tensor`` (see :func:`shard_rowwise`)."""
    spec = ShardingSpec(tensor.dim(), {-1: [0]})
    return distribute_tensor(tensor, _one_dim_mesh(group_or_device_mesh), spec)


def sharded_tensor_to_param(tensor: torch.Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
    """A module parameter of a distributed tensor, keeping its layout.

    Raises:
        TypeError: ``tensor`` is not a distributed tensor.
    """
    layout = get_layout(tensor)
    param = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    assert isinstance(param, _LayoutTensor)
    param.dist_layout = layout
    return param


def to_global(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a plain tensor), differentiable; COLLECTIVE."""
    layout = get_layout(tensor)
    assert isinstance(tensor, DTensor)
    full = DTensor.redistribute(
        tensor, tensor.device_mesh, [Replicate()] * len(layout.placements())
    )
    return full.to_local()
