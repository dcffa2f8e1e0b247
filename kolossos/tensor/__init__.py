"""Distributed tensors (``colossalai.tensor``): ColoTensor / ColoParameter with Colossal-AI's
process group and dist/compute specs over PyTorch DTensor, the ``S0/S1/S01/R`` sharding-spec
notation and the layout converter (:mod:`kolossos.tensor.d_tensor`). See ``docs/tensor.md``.

Example:
    >>> pg = ProcessGroup(tp_degree=2, dp_degree=2)  # doctest: +SKIP
    >>> spec = ColoTensorSpec(pg, ShardSpec([-1], [pg.tp_world_size()]))  # doctest: +SKIP
    >>> t = ColoTensor.from_torch_tensor(torch.randn(2, 3, 1), spec)  # doctest: +SKIP
    >>> full = t.to_replicate()  # doctest: +SKIP
"""

from kolossos.tensor import distspec
from kolossos.tensor.colo_parameter import ColoParameter
from kolossos.tensor.colo_tensor import ColoTensor
from kolossos.tensor.comm_spec import CollectiveCommPattern, CommSpec
from kolossos.tensor.compute_spec import ComputePattern, ComputeSpec
from kolossos.tensor.dist_spec_mgr import DistSpecManager
from kolossos.tensor.distspec import ReplicaSpec, ShardSpec
from kolossos.tensor.param_op_hook import ColoParamOpHook, ColoParamOpHookManager
from kolossos.tensor.process_group import ProcessGroup
from kolossos.tensor.sharding_spec import (
    ShardingSpec,
    convert_dim_partition_dict,
    merge_same_dim_mesh_list,
)
from kolossos.tensor.tensor_spec import ColoTensorSpec
from kolossos.tensor.utils import (
    convert_parameter,
    full_state_dict,
    named_params_with_colotensor,
)

__all__ = [
    "CollectiveCommPattern",
    "ColoParamOpHook",
    "ColoParamOpHookManager",
    "ColoParameter",
    "ColoTensor",
    "ColoTensorSpec",
    "CommSpec",
    "ComputePattern",
    "ComputeSpec",
    "DistSpecManager",
    "ProcessGroup",
    "ReplicaSpec",
    "ShardSpec",
    "ShardingSpec",
    "convert_dim_partition_dict",
    "convert_parameter",
    "distspec",
    "full_state_dict",
    "merge_same_dim_mesh_list",
    "named_params_with_colotensor",
]
