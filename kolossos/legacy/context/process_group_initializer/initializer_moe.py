"""``Initializer_Moe``: the groups of ``parallel = dict(moe=dict(size=E))``.

``ParallelMode.MOE_MODEL``: blocks of ``E`` consecutive data-parallel ranks, which share out the
experts of every MoE layer; ``ParallelMode.MOE_DATA``: the ranks at the same position of each
block, which hold the same experts and average their gradients (world 4, ``E = 2``: MOE_MODEL
``[0, 1]``, ``[2, 3]``; MOE_DATA ``[0, 2]``, ``[1, 3]``, the documented picture). The layout
also becomes :data:`kolossos.moe.MOE_CONTEXT`'s, which new ``Experts`` read.
"""

from __future__ import annotations

from typing import Any

from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.context.process_group_initializer.process_group_initializer import (
    GroupSetting,
    ProcessGroupInitializer,
)
from kolossos.legacy.registry import DIST_GROUP_INITIALIZER
from kolossos.moe import MOE_CONTEXT, MoeParallelInfo, moe_group_ranks

__all__ = ["Initializer_Moe"]


@DIST_GROUP_INITIALIZER.register_module
class Initializer_Moe(ProcessGroupInitializer):
    """MoE model-parallel (expert-parallel) and MoE data-parallel groups.

    Args:
        *args: the base class's arguments.
        moe_size: ``parallel.moe.size``, the expert-parallel size.
    """

    def __init__(self, *args: Any, moe_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moe_size = moe_size

    def init_dist_group(self) -> list[GroupSetting | None]:
        ep_groups, dp_groups = moe_group_ranks(self.world_size, self.moe_size)
        model = self.build_groups(ep_groups, ParallelMode.MOE_MODEL)
        data = self.build_groups(dp_groups, ParallelMode.MOE_DATA)
        assert model is not None and data is not None  # every rank is in one group of each
        MOE_CONTEXT.set_parallel_info(
            MoeParallelInfo(
                ep_size=model.world_size,
                ep_rank=model.local_rank,
                ep_group=model.process_group if model.world_size > 1 else None,
                dp_size=data.world_size,
                dp_group=data.process_group if data.world_size > 1 else None,
            )
        )
        return [model, data]
