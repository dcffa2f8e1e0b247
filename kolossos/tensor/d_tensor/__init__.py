"""Distributed tensors on an N-d :class:`kolossos.device.device_mesh.DeviceMesh`
(``colossalai.tensor.d_tensor``): sharding specs, layouts, the layout converter."""

from kolossos.tensor.d_tensor.api import (
    compute_global_numel,
    distribute_tensor,
    get_device_mesh,
    get_global_shape,
    get_layout,
    get_sharding_spec,
    is_distributed_tensor,
    is_sharded,
    redistribute,
    shard_colwise,
    shard_rowwise,
    sharded_tensor_to_param,
    to_global,
)
from kolossos.tensor.d_tensor.layout import Layout
from kolossos.tensor.d_tensor.layout_converter import LayoutConverter
from kolossos.tensor.sharding_spec import ShardingSpec

__all__ = [
    "Layout",
    "LayoutConverter",
    "ShardingSpec",
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
