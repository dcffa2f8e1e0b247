"""``ColoTensorSpec``: the process group, dist spec and compute spec of a ColoTensor."""

from __future__ import annotations

from dataclasses import dataclass, field

from kolossos.tensor.compute_spec import ComputeSpec
from kolossos.tensor.distspec import ReplicaSpec, ShardSpec
from kolossos.tensor.process_group import ProcessGroup

__all__ = ["ColoTensorSpec"]


@dataclass
class ColoTensorSpec:
    """Everything :meth:`ColoTensor.from_torch_tensor` needs to know about a tensor.

    Example:
        >>> spec = ColoTensorSpec(pg, ShardSpec([-1], [pg.tp_world_size()]))  # doctest: +SKIP
    """

    #: the tp x dp layout of the processes
    pg: ProcessGroup
    #: how the tensor is spread over the tp group (default: replicated)
    dist_attr: ReplicaSpec | ShardSpec = field(default_factory=ReplicaSpec)
    #: the tensor-parallel compute pattern (parameters only)
    compute_attr: ComputeSpec | None = None
