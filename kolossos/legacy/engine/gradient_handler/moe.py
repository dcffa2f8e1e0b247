"""``MoeGradientHandler``: data-parallel gradient averaging for a mixture-of-experts model,
where expert parameters have their own, smaller, data-parallel groups."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from kolossos.cluster.collectives import all_reduce_coalesced
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler
from kolossos.legacy.registry import GRADIENT_HANDLER

__all__ = ["ExpertParallelInfo", "MoeGradientHandler"]


@runtime_checkable
class ExpertParallelInfo(Protocol):
    """What an expert parameter carries as its ``moe_info`` attribute."""

    ep_size: int
    """Ranks the experts of this parameter's layer are spread over."""
    dp_group: dist.ProcessGroup | None
    """The ranks holding the same expert (its data-parallel group); ``None``: only this rank."""


def _expert_info(param: torch.Tensor) -> ExpertParallelInfo | None:
    info = vars(param).get("moe_info")
    if info is None:
        return None
    if not isinstance(info, ExpertParallelInfo):
        raise TypeError(
            f"a parameter's moe_info is {type(info).__name__}, without ep_size and dp_group; "
            "build expert layers with kolossos' MoE layers, which set both."
        )
    return info


@GRADIENT_HANDLER.register_module
class MoeGradientHandler(BaseGradientHandler):
    """Average the gradients of ordinary parameters over ``ParallelMode.DATA`` and those of
    expert parameters (``param.moe_info``, see :class:`ExpertParallelInfo`) over their expert
    data-parallel group (skipped when that group is this rank alone). One flat all-reduce per
    group and dtype; the groups are visited in the same order on every rank.

    Select it with ``gradient_handler = [dict(type="MoeGradientHandler")]``.
    """

    def handle_gradient(self) -> None:
        """All-reduce and average (collectives over DATA and the expert data groups)."""
        if gpc.get_world_size(ParallelMode.DATA) == 1:
            return
        dense: list[torch.Tensor] = []
        experts: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
        order: list[int] = []
        for p in self._model.parameters():
            if not p.requires_grad or p.grad is None:
                continue
            info = _expert_info(p)
            if info is None:
                dense.append(p.grad)
            elif info.dp_group is not None and dist.get_world_size(info.dp_group) > 1:
                key = id(info.dp_group)
                if key not in experts:
                    experts[key] = (info.dp_group, [])
                    order.append(key)
                experts[key][1].append(p.grad)
        groups = [(gpc.get_group(ParallelMode.DATA), dense)] + [experts[k] for k in order]
        for group, grads in groups:
            size = dist.get_world_size(group)
            for grad in grads:
                grad.div_(size)
            # SYNC POINT: every rank of the group holds the same parameters in one order
            all_reduce_coalesced(grads, group)
