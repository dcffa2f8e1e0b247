"""The process groups of one model replica: tensor-parallel, pipeline and the whole replica.

Ranks are laid out as ``(replica, pp, tp)``: ``tp_size`` consecutive ranks split one pipeline
stage's blocks, ``pp_size`` such runs form the stages of one replica, and the world holds
``world / (tp_size * pp_size)`` replicas that generate independently. At tp 2 x pp 2 on 4 ranks:
tensor-parallel groups ``{0, 1}`` (stage 0) and ``{2, 3}`` (stage 1); pipeline groups ``{0, 2}``
and ``{1, 3}`` (each tp rank sends its hidden states to the rank with the same tp index on the
next stage); the replica ``{0, 1, 2, 3}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.cluster import ProcessGroupMesh

__all__ = ["ReplicaGroups", "replica_groups"]


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's groups (``None`` for an axis of size 1)."""

    tp: ProcessGroup | None
    """The ranks splitting this stage's blocks by head (tensor parallelism)."""
    pp: ProcessGroup | None
    """One rank per stage, the same tensor-parallel index on each (hidden states flow here)."""
    replica: ProcessGroup | None
    """Every rank of this replica (plans, prompt checks and the chosen tokens go here)."""
    token_source: int
    """The global rank whose chosen tokens every rank of the replica takes: the first
    tensor-parallel rank of the last stage (the stage with the logits)."""
    stage: int
    """This rank's pipeline stage (0 without pipeline parallelism)."""


def replica_groups(tp_size: int, pp_size: int) -> ReplicaGroups:
    """Build this rank's groups; every rank calls it together (group creation is collective).

    Raises:
        RuntimeError: a size above 1 without an initialised torch.distributed.
        ValueError: ``tp_size * pp_size`` does not divide the world size.
    """
    name = f"InferenceConfig(tp_size={tp_size}, pp_size={pp_size})"
    if tp_size * pp_size == 1:
        return ReplicaGroups(None, None, None, token_source=0, stage=0)
    if not dist.is_initialized():
        raise RuntimeError(
            f"{name} needs torch.distributed: start the job with torchrun and call "
            "kolossos.launch_from_torch() first (or use tp_size=1 and pp_size=1)."
        )
    world = dist.get_world_size()
    size = tp_size * pp_size
    if world % size:
        raise ValueError(
            f"{name}: tp_size * pp_size = {size} must divide the world size {world}; choose "
            "sizes whose product divides it, or start the job with a multiple of that many "
            "processes."
        )
    mesh = ProcessGroupMesh(world // size, pp_size, tp_size, axis_names=("replica", "pp", "tp"))
    tp = mesh.get_group_along_axis("tp") if tp_size > 1 else None
    pp = mesh.get_group_along_axis("pp") if pp_size > 1 else None
    if tp is None or pp is None:
        replica = tp if pp is None else pp
    else:
        replica = mesh.get_group_along_axis(("pp", "tp"))
    coord = mesh.coordinate()
    assert isinstance(coord, tuple)
    source = mesh.rank_at((coord[0], pp_size - 1, 0))
    return ReplicaGroups(tp, pp, replica, token_source=source, stage=coord[1])
