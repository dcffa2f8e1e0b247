"""Dist specs of ColoTensor (``colossalai.tensor.distspec``): how a tensor is spread over the
tensor-parallel group of its :class:`~kolossos.tensor.ProcessGroup`.

``ReplicaSpec()``: every rank of the group holds the whole tensor. ``ShardSpec(dims=[d],
num_partitions=[n])``: dimension ``d`` is cut into ``n`` equal pieces, one per rank (``n`` is the
tp group size; one dimension only, as in Colossal-AI). Data parallelism is not described here:
parameters are replicated over the dp group.

Example:
    >>> ShardSpec(dims=[-1], num_partitions=[2])
    ShardSpec(dims=[-1], num_partitions=[2])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["DistPlacementPattern", "ReplicaSpec", "ShardSpec", "replicate", "shard"]


class DistPlacementPattern(Enum):
    """Whether a dist spec replicates or shards."""

    REPLICATE = "r"
    SHARD = "s"


@dataclass(frozen=True)
class _DistSpec:
    placement: DistPlacementPattern


@dataclass(frozen=True, init=False)
class ReplicaSpec(_DistSpec):
    """Every rank of the tensor-parallel group holds the whole tensor."""

    def __init__(self) -> None:
        object.__setattr__(self, "placement", DistPlacementPattern.REPLICATE)

    def __repr__(self) -> str:
        return "ReplicaSpec()"


@dataclass(frozen=True, init=False)
class ShardSpec(_DistSpec):
    """Dimension ``dims[0]`` cut into ``num_partitions[0]`` equal pieces over the tp group.

    Args:
        dims: the tensor dimension to cut, as a one-element list (negative counts from the end).
        num_partitions: the number of pieces, as a one-element list (the tp group size).

    Raises:
        ValueError: lengths other than one, or a partition count below 1.
    """

    dims: list[int] = field(default_factory=list)
    num_partitions: list[int] = field(default_factory=list)

    def __init__(self, dims: list[int], num_partitions: list[int]) -> None:
        dims, parts = list(dims), list(num_partitions)
        if len(dims) != 1 or len(parts) != 1:
            raise ValueError(
                f"ShardSpec(dims={dims}, num_partitions={parts}): ColoTensor shards one dimension; "
                "give one dim and one partition count, e.g. ShardSpec([-1], [tp_size])."
            )
        if isinstance(parts[0], bool) or not isinstance(parts[0], int) or parts[0] < 1:
            raise ValueError(f"ShardSpec: num_partitions={parts} must hold a positive int.")
        object.__setattr__(self, "placement", DistPlacementPattern.SHARD)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "num_partitions", parts)

    def __hash__(self) -> int:
        return hash((tuple(self.dims), tuple(self.num_partitions)))

    def __repr__(self) -> str:
        return f"ShardSpec(dims={self.dims}, num_partitions={self.num_partitions})"


def replicate() -> ReplicaSpec:
    """``ReplicaSpec()`` (Colossal-AI's ``distspec.replicate``)."""
    return ReplicaSpec()


def shard(dims: list[int], num_partitions: list[int]) -> ShardSpec:
    """``ShardSpec(dims, num_partitions)`` (Colossal-AI's ``distspec.shard``)."""
    return ShardSpec(dims, num_partitions)
