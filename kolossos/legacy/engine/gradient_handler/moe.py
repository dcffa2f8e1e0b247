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


def _replicas(info: ExpertParallelInfo) -> int:
    """How many data-parallel ranks feed this expert: its expert-parallel group's ranks (whose
    tokens reach it through the all-to-all) times its replicas."""
    dp = dist.get_world_size(info.dp_group) if info.dp_group is not None else 1
    return info.ep_size * dp


@GRADIENT_HANDLER.register_module
class MoeGradientHandler(BaseGradientHandler):
    """Average the gradients of ordinary parameters over ``ParallelMode.DATA``, and those of
    expert parameters (``param.moe_info``, see :class:`ExpertParallelInfo`) over the same
    data-parallel world through their own group.

    An expert's local gradient already *sums* the contributions of the tokens of every rank of
    its expert-parallel group (the all-to-all's backward brings them back), so it is summed over
    its expert data-parallel group ``moe_info.dp_group`` (skipped when that group is this rank
    alone) and divided by the whole data-parallel size ``ep_size * dp_size``, not by the size of
    ``dp_group``: that makes it the gradient of the mean loss over all ranks, as for ordinary
    parameters. One flat all-reduce per group and dtype; the groups are visited in the same
    order on every rank.

    Select it with ``gradient_handler = [dict(type="MoeGradientHandler")]``; ``initialize`` adds
    it by itself when the model has expert parameters.
    """

    def handle_gradient(self) -> None:
        """All-reduce and average (collectives over DATA and the expert data groups).

        Raises:
            ValueError: an expert's ``ep_size * dp_size`` is not the DATA size (its groups do
                not tile the data-parallel world, so its gradient would be averaged wrongly).
        """
        data_size = gpc.get_world_size(ParallelMode.DATA)
        if data_size == 1:
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
                continue
            if _replicas(info) != data_size:
                raise ValueError(
                    f"an expert parameter has ep_size {info.ep_size} x expert data-parallel size "
                    f"{_replicas(info) // info.ep_size} = {_replicas(info)} ranks, but the DATA "
                    f"size is {data_size}; build the experts with the groups of "
                    "parallel=dict(moe=dict(size=...)) (kolossos.moe.MOE_CONTEXT)."
                )
            p.grad.div_(data_size)
            if info.dp_group is not None and dist.get_world_size(info.dp_group) > 1:
                key = id(info.dp_group)
                if key not in experts:
                    experts[key] = (info.dp_group, [])
                    order.append(key)
                experts[key][1].append(p.grad)
        for grad in dense:
            grad.div_(data_size)
        groups = [(gpc.get_group(ParallelMode.DATA), dense)] + [experts[k] for k in order]
        for group, grads in groups:
            # SYNC POINT: every rank of the group holds the same parameters in one order
            all_reduce_coalesced(grads, group)
