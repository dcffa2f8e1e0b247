"""``ProcessGroupInitializer``: the base of every legacy process-group initializer."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["GroupSetting", "ProcessGroupInitializer"]


class GroupSetting(NamedTuple):
    """What an initializer reports for this rank: its place in one group of one mode."""

    local_rank: int
    world_size: int
    process_group: ProcessGroup
    cpu_group: ProcessGroup | None
    ranks_in_group: list[int]
    mode: Hashable


class ProcessGroupInitializer:
    """Builds the process groups of one parallel mode.

    The first six constructor arguments are fixed (``ParallelContext`` passes them); a subclass
    may take more, which come from the config (``tensor=dict(size=4, mode="my_mode", arg1=1)``).
    Implement ``init_dist_group`` (Colossal-AI's name) or ``init_parallel_groups`` (the
    documented recipe's name); either returns a :class:`GroupSetting`-like 6-tuple
    ``(local_rank, group_world_size, group, cpu_group, ranks, mode)``, a list of them, or
    ``None``. :meth:`build_groups` does the ``new_group`` calls in the required order.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        config: the launch config (:class:`kolossos.legacy.context.Config`).
        data_parallel_size / pipeline_parallel_size / tensor_parallel_size: the sizes
            ``ParallelContext`` inferred (default 1 for initializers that only pass three).

    Example:
        >>> @DIST_GROUP_INITIALIZER.register_module  # doctest: +SKIP
        ... class Pairs(ProcessGroupInitializer):
        ...     def init_dist_group(self):
        ...         pairs = [[r, r + 1] for r in range(0, self.world_size, 2)]
        ...         return self.build_groups(pairs, "pairs")
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: Any,
        data_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.data_parallel_size = data_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.tensor_parallel_size = tensor_parallel_size

    def init_dist_group(self) -> Any:
        """Create the groups; return this rank's setting(s). Defaults to
        :meth:`init_parallel_groups`."""
        if type(self).init_parallel_groups is ProcessGroupInitializer.init_parallel_groups:
            raise NotImplementedError(
                f"{type(self).__name__} must implement init_dist_group() (or "
                "init_parallel_groups())."
            )
        return self.init_parallel_groups()

    def init_parallel_groups(self) -> Any:
        """The documented recipe's name for :meth:`init_dist_group`."""
        return self.init_dist_group()

    def build_groups(
        self, all_ranks: Sequence[Sequence[int]], mode: Hashable
    ) -> GroupSetting | None:
        """Create one process group per rank list (on every rank, in this order) and return
        this rank's :class:`GroupSetting` (``None`` when it is in none of them).

        COLLECTIVE over the world: ``new_group`` must be called by every rank for every group.
        With a backend other than gloo, each group also gets a gloo twin (``get_cpu_group``).
        """
        mine: GroupSetting | None = None
        gloo_twin = dist.get_backend() != "gloo"
        for ranks in all_ranks:
            ranks = list(ranks)
            group = dist.new_group(ranks)  # SYNC POINT: every rank creates every group
            cpu = dist.new_group(ranks, backend="gloo") if gloo_twin else group
            if self.rank in ranks:
                assert group is not None
                mine = GroupSetting(ranks.index(self.rank), len(ranks), group, cpu, ranks, mode)
        return mine
