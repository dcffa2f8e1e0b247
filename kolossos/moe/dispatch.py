"""Dispatch and combine: tokens to their experts' ranks and back, without padding the wire.

For one routing (:class:`~kolossos.moe.routers.Routing`) of this rank's ``S`` tokens:

1. the kept ``(token, choice)`` pairs are sorted by expert (stable: choice-major, token order),
   and each expert's row count is sent to the expert's rank (``all_to_all_single`` of the
   counts);
2. the rows travel with one ``all_to_all_single`` on uneven splits (only kept tokens, no
   capacity padding on the wire);
3. the receiving rank groups its rows by local expert, pads them to the largest local count
   (``[E_local, C, H]``, in memory only) and runs all its experts in one batched call;
4. the outputs travel back the same way and each token sums its choices' outputs, weighted by
   the router's combine weights (dropped choices contribute nothing).

Every step is differentiable; the all-to-alls are collectives over the expert-parallel group in
forward and backward. With ``ep_size`` 1 no collective runs and the rows stay in place.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kolossos.moe.all_to_all import all_to_all_uneven, exchange_counts
from kolossos.moe.parallel_info import MoeParallelInfo
from kolossos.moe.routers import Routing

__all__ = ["LocalExperts", "run_experts"]


class LocalExperts(Protocol):
    """What dispatch needs of a rank's experts (:class:`~kolossos.moe.experts.Experts`, or the
    Hugging Face fused experts of :mod:`kolossos.moe.hf_block`)."""

    moe_info: MoeParallelInfo
    num_total_experts: int

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor: ...


def _pairs(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expert, token, weight)`` of the kept pairs, grouped by expert (stable order)."""
    tokens, k = routing.expert_index.shape
    expert = routing.expert_index.t().reshape(-1)
    token = torch.arange(tokens, device=expert.device).repeat(k)
    weight = routing.combine_weight.t().reshape(-1)
    keep = routing.kept.t().reshape(-1)
    expert, token, weight = expert[keep], token[keep], weight[keep]
    order = torch.argsort(expert, stable=True)
    return expert[order], token[order], weight[order]


def _compute_local(
    recv: torch.Tensor, recv_counts: torch.Tensor, experts: LocalExperts
) -> torch.Tensor:
    """Rows received in ``(source rank, local expert)`` order → their experts' outputs, in the
    same order. One batched expert call over ``[E_local, C, H]``."""
    ep, local = recv_counts.shape
    device = recv.device
    segment = torch.repeat_interleave(
        torch.arange(ep * local, device=device), recv_counts.reshape(-1)
    )
    owner, source = segment % local, segment // local
    perm = torch.argsort(owner * ep + source, stable=True)  # group rows by local expert
    owner = owner[perm]
    per_expert = recv_counts.sum(0)
    starts = torch.cumsum(per_expert, 0) - per_expert
    slot = torch.arange(recv.shape[0], device=device) - starts[owner]
    width = int(per_expert.max()) if recv.shape[0] else 0
    padded = recv.new_zeros(local, width, recv.shape[1])
    padded = torch.index_put(padded, (owner, slot), recv[perm])
    out = experts(padded)
    return out[owner, slot][torch.argsort(perm)]


def run_experts(tokens: torch.Tensor, routing: Routing, experts: LocalExperts) -> torch.Tensor:
    """The MoE output ``[S, H']`` of ``tokens [S, H]`` routed by ``routing``.

    COLLECTIVE over ``experts.moe_info.ep_group`` (two all-to-alls of rows, one of counts).
    """
    info = experts.moe_info
    expert, token, weight = _pairs(routing)
    counts = torch.bincount(expert, minlength=experts.num_total_experts)
    recv_counts = exchange_counts(counts, info.ep_group)
    send_splits = counts.reshape(info.ep_size, -1).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    recv = all_to_all_uneven(tokens.index_select(0, token), recv_splits, send_splits, info.ep_group)
    result = _compute_local(recv, recv_counts, experts)
    back = all_to_all_uneven(result, send_splits, recv_splits, info.ep_group)
    weighted = back * weight.to(back.dtype).unsqueeze(1)
    return back.new_zeros(tokens.shape[0], back.shape[1]).index_add(0, token, weighted)
