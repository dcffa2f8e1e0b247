"""``MoeLayer``: gate → router → experts (possibly on other ranks) → weighted sum.

``MoeLayer(dim_model, num_experts, router, experts)`` owns only the gate, a bias-free linear map
``dim_model → num_experts`` evaluated in fp32; the router and the experts are passed in (and
may be shared between layers, as WideNet shares them). ``forward`` returns a tensor of the
input's shape and records the router's load-balancing loss and z-loss in
:data:`~kolossos.moe.context.MOE_CONTEXT`, where :class:`~kolossos.moe.loss.MoeLoss` collects
them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kolossos.moe.context import MOE_CONTEXT
from kolossos.moe.dispatch import run_experts
from kolossos.moe.experts import Experts
from kolossos.moe.routers import MoeRouter, Routing

__all__ = ["MoeLayer"]


class MoeLayer(nn.Module):
    """A mixture-of-experts layer.

    Args:
        dim_model: the hidden size of the tokens.
        num_experts: the number of experts (all ranks together); must match ``experts``.
        router: the routing rule (``Top1Router``, ``Top2Router``, ``TopKRouter``).
        experts: this rank's experts (:class:`~kolossos.moe.experts.Experts`).

    Raises:
        ValueError: ``num_experts`` differs from the experts'.

    Example:
        >>> from kolossos.moe import Top1Router
        >>> experts = Experts(expert=nn.Linear, num_experts=2, in_features=4, out_features=4)
        >>> layer = MoeLayer(4, 2, Top1Router(capacity_factor_train=None), experts)
        >>> layer(torch.ones(2, 3, 4)).shape
        torch.Size([2, 3, 4])
    """

    def __init__(
        self, dim_model: int, num_experts: int, router: MoeRouter, experts: Experts
    ) -> None:
        super().__init__()
        if experts.num_total_experts != num_experts:
            raise ValueError(
                f"MoeLayer(num_experts={num_experts}) but the experts were built for "
                f"{experts.num_total_experts}; pass the same number to both."
            )
        self.d_model = dim_model
        self.num_experts = num_experts
        self.gate = nn.Linear(dim_model, num_experts, bias=False)
        nn.init.trunc_normal_(self.gate.weight, std=math.sqrt(0.1 / dim_model))
        self.router = router
        self.experts = experts
        self.last_routing: Routing | None = None
        """The last forward's routing, detached (for inspection and tests)."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Route every token of ``inputs [..., dim_model]``; returns the same shape.

        COLLECTIVE over the experts' expert-parallel group.
        """
        if inputs.shape[-1] != self.d_model:
            raise ValueError(
                f"MoeLayer input of shape {tuple(inputs.shape)}: the last dimension must be "
                f"dim_model={self.d_model}."
            )
        tokens = inputs.reshape(-1, self.d_model)
        logits = F.linear(tokens.float(), self.gate.weight.float())
        routing = self.router(logits)
        self.last_routing = dataclasses.replace(
            routing,
            combine_weight=routing.combine_weight.detach(),
            aux_loss=routing.aux_loss.detach(),
            z_loss=routing.z_loss.detach(),
        )
        MOE_CONTEXT.add_loss(routing.aux_loss, routing.z_loss)
        out = run_experts(tokens, routing, self.experts)
        return out.to(inputs.dtype).reshape(*inputs.shape[:-1], out.shape[-1])
