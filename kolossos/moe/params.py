"""Which parameters are experts, and keeping expert replicas equal.

An expert parameter carries ``param.moe_info`` (a
:class:`~kolossos.moe.parallel_info.MoeParallelInfo`): it is replicated only over its expert
data-parallel group (``moe_info.dp_group``), not over the whole data-parallel world, so code
that broadcasts or averages "every parameter" over the data-parallel group must skip it and use
that group instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.moe.parallel_info import MoeParallelInfo

__all__ = ["is_moe_param", "moe_info_of", "sync_moe_params"]


def moe_info_of(param: torch.Tensor) -> MoeParallelInfo | None:
    """The parameter's ``moe_info``, or ``None`` for an ordinary parameter."""
    info = vars(param).get("moe_info")
    return info if isinstance(info, MoeParallelInfo) else None


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (carries ``moe_info``)."""
    return "moe_info" in vars(param)


def sync_moe_params(model: nn.Module) -> None:
    """Broadcast every expert parameter from the first rank of its expert data-parallel group,
    so its replicas start equal (what a data-parallel broadcast does for ordinary ones).

    COLLECTIVE over each expert data-parallel group, in parameter order on every rank.
    """
    with torch.no_grad():
        for param in model.parameters():
            info = moe_info_of(param)
            if info is None or info.dp_group is None:
                continue
            src = dist.get_global_rank(info.dp_group, 0)
            dist.broadcast(param.data, src=src, group=info.dp_group)  # SYNC POINT
