"""``CommSpec``: one step of a layout conversion — which collective, on which tensor
dimensions, along which mesh axis — and its modelled cost.

Example:
    >>> spec = CommSpec(CollectiveCommPattern.GATHER_FWD_SPLIT_BWD, gather_dim=0, shard_dim=0,
    ...                 logical_process_axis=1)
    >>> spec
    CommSpec(all-gather dim 0 along mesh axis 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["CollectiveCommPattern", "CommSpec"]


class CollectiveCommPattern(Enum):
    """The forward/backward collective pair of a step (Colossal-AI's names)."""

    GATHER_FWD_SPLIT_BWD = "all_gather_fwd_split_bwd"
    ALL2ALL_FWD_ALL2ALL_BWD = "all_to_all_fwd_all_to_all_bwd"
    SPLIT_FWD_GATHER_BWD = "split_fwd_all_gather_bwd"
    ALLREDUCE_FWD_IDENTITY_BWD = "all_reduce_fwd_identity_bwd"
    IDENTITY_FWD_ALLREDUCE_BWD = "identity_fwd_all_reduce_bwd"


_NAMES = {
    CollectiveCommPattern.GATHER_FWD_SPLIT_BWD: "all-gather",
    CollectiveCommPattern.ALL2ALL_FWD_ALL2ALL_BWD: "all-to-all",
    CollectiveCommPattern.SPLIT_FWD_GATHER_BWD: "shard",
    CollectiveCommPattern.ALLREDUCE_FWD_IDENTITY_BWD: "all-reduce",
    CollectiveCommPattern.IDENTITY_FWD_ALLREDUCE_BWD: "identity",
}


@dataclass(frozen=True, kw_only=True)
class CommSpec:
    """One conversion step. Positional ``comm_pattern``, then keywords.

    Attributes are Colossal-AI's: ``gather_dim`` is the tensor dimension made whole (or, for a
    shard, cut), ``shard_dim`` the dimension cut, ``logical_process_axis`` the mesh axis.
    """

    #: the collective pattern
    comm_pattern: CollectiveCommPattern
    #: tensor dimension the step gathers (all-gather, all-to-all) or cuts (shard)
    gather_dim: int
    #: tensor dimension the step cuts
    shard_dim: int
    #: the mesh axis along which the step communicates
    logical_process_axis: int

    def __init__(
        self,
        comm_pattern: CollectiveCommPattern,
        *,
        gather_dim: int,
        shard_dim: int,
        logical_process_axis: int,
    ) -> None:
        if not isinstance(comm_pattern, CollectiveCommPattern):
            raise TypeError(f"CommSpec({comm_pattern!r}): pass a CollectiveCommPattern.")
        object.__setattr__(self, "comm_pattern", comm_pattern)
        object.__setattr__(self, "gather_dim", gather_dim)
        object.__setattr__(self, "shard_dim", shard_dim)
        object.__setattr__(self, "logical_process_axis", logical_process_axis)

    @property
    def name(self) -> str:
        """``"all-gather"``, ``"all-to-all"`` or ``"shard"``."""
        return _NAMES[self.comm_pattern]

    def __repr__(self) -> str:
        axis = self.logical_process_axis
        if self.comm_pattern is CollectiveCommPattern.ALL2ALL_FWD_ALL2ALL_BWD:
            moved = f"{self.gather_dim} -> {self.shard_dim}"
            return f"CommSpec(all-to-all dim {moved} along mesh axis {axis})"
        return f"CommSpec({self.name} dim {self.gather_dim} along mesh axis {axis})"
