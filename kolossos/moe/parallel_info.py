"""Expert-parallel process groups: who holds which experts, and who shares an expert's gradient.

The documented layout (Colossal-AI's MoE page, ``parallel = dict(moe=dict(size=E))``): blocks of
``ep_size`` *consecutive* ranks form an expert-parallel group, each rank of a block holding
``num_experts / ep_size`` experts; the ranks at the same position of every block hold the same
experts and form that expert's data-parallel group (world 4, ep 2: EP groups ``[0, 1]``,
``[2, 3]``; expert DP groups ``[0, 2]``, ``[1, 3]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["MoeParallelInfo", "create_moe_groups", "moe_group_ranks", "single_process_info"]

Groups = list[list[int]]


@dataclass(frozen=True, kw_only=True)
class MoeParallelInfo:
    """This rank's place in the expert-parallel layout; carried by every expert parameter as
    ``param.moe_info`` (it satisfies
    :class:`~kolossos.legacy.engine.gradient_handler.moe.ExpertParallelInfo`).

    Example:
        >>> info = single_process_info()
        >>> (info.ep_size, info.ep_rank, info.dp_size)
        (1, 0, 1)
    """

    ep_size: int
    """Ranks the experts of a layer are spread over (consecutive ranks)."""
    ep_rank: int
    """This rank's index inside its expert-parallel group."""
    ep_group: dist.ProcessGroup | None
    """The expert-parallel group (``None``: this rank alone, ``ep_size == 1``)."""
    dp_size: int
    """Ranks holding the same experts (the expert data-parallel size)."""
    dp_group: dist.ProcessGroup | None
    """Those ranks' group (``None``: this rank alone, ``dp_size == 1``)."""

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.dp_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(
                f"MoeParallelInfo: ep_size={self.ep_size}, dp_size={self.dp_size} must be >= 1 "
                f"and ep_rank={self.ep_rank} in [0, ep_size)."
            )
        if (self.ep_group is None) != (self.ep_size == 1):
            raise ValueError(
                f"MoeParallelInfo: ep_group must be None exactly when ep_size is 1 (ep_size="
                f"{self.ep_size}, ep_group={self.ep_group!r})."
            )
        if (self.dp_group is None) != (self.dp_size == 1):
            raise ValueError(
                f"MoeParallelInfo: dp_group must be None exactly when dp_size is 1 (dp_size="
                f"{self.dp_size}, dp_group={self.dp_group!r})."
            )

    def local_experts(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds (a contiguous block).

        Raises:
            ValueError: ``num_experts`` is not a multiple of ``ep_size``.
        """
        if num_experts < 1 or num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be a positive multiple of the expert-parallel "
                f"size {self.ep_size} (each rank holds num_experts / ep_size experts); change "
                "num_experts or parallel.moe.size."
            )
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)


def single_process_info() -> MoeParallelInfo:
    """Every expert on this rank, nobody to share gradients with."""
    return MoeParallelInfo(ep_size=1, ep_rank=0, ep_group=None, dp_size=1, dp_group=None)


def moe_group_ranks(world_size: int, ep_size: int) -> tuple[Groups, Groups]:
    """``(expert-parallel groups, expert data-parallel groups)`` of the documented layout.

    Raises:
        ValueError: ``ep_size`` does not divide ``world_size``.

    Example:
        >>> moe_group_ranks(4, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(
            f"expert-parallel size {ep_size} must divide the world size {world_size}; launch a "
            f"multiple of {ep_size} processes or change parallel.moe.size."
        )
    dp_size = world_size // ep_size
    ep_groups = [[b * ep_size + i for i in range(ep_size)] for b in range(dp_size)]
    dp_groups = [[b * ep_size + i for b in range(dp_size)] for i in range(ep_size)]
    return ep_groups, dp_groups


def _new_group(ranks: list[int], world_size: int) -> dist.ProcessGroup | None:
    if len(ranks) == 1:
        return None
    if len(ranks) == world_size:
        return dist.group.WORLD
    return dist.new_group(ranks)  # SYNC POINT: every rank creates every group


def create_moe_groups(ep_size: int) -> MoeParallelInfo:
    """Create the expert-parallel and expert data-parallel groups over the default group.

    COLLECTIVE over the world: every rank calls it with the same ``ep_size``.

    Raises:
        RuntimeError: no process group.
        ValueError: ``ep_size`` does not divide the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "create_moe_groups needs the default process group: call kolossos.launch* first."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_groups, dp_groups = moe_group_ranks(world, ep_size)
    mine: dict[str, tuple[list[int], dist.ProcessGroup | None]] = {}
    for kind, all_ranks in (("ep", ep_groups), ("dp", dp_groups)):
        for ranks in all_ranks:
            group = _new_group(ranks, world)
            if rank in ranks:
                mine[kind] = (ranks, group)
    (ep_ranks, ep_group), (dp_ranks, dp_group) = mine["ep"], mine["dp"]
    return MoeParallelInfo(
        ep_size=len(ep_ranks),
        ep_rank=ep_ranks.index(rank),
        ep_group=ep_group,
        dp_size=len(dp_ranks),
        dp_group=dp_group,
    )
