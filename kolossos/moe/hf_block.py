"""Hugging Face sparse MoE blocks (Mixtral, Qwen2-MoE) with their experts spread over an
expert-parallel group.

:class:`FusedGatedExperts` holds this rank's slice of the Hugging Face fused expert tensors
(``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, the layout of transformers 5.x) under
the same names, so a state dict of the block has Hugging Face's keys; it computes its local
experts with two batched matmuls (``torch.bmm`` over ``[E_local, C, H]``).

:class:`ExpertParallelMoeBlock` keeps the block's own router module (``gate``), so the routing
— softmax in fp32, top-k, the renormalisation Mixtral always does and Qwen2-MoE does when
``norm_topk_prob`` — and the router logits Hugging Face records for its load-balancing loss
(``output_router_logits=True``) are exactly Hugging Face's; no token is dropped (HF drops none).
The tokens then travel to their experts' ranks with :func:`~kolossos.moe.dispatch.run_experts`.
A Qwen2-MoE block's shared expert and its sigmoid gate are kept as they are (replicated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from kolossos.moe.dispatch import run_experts
from kolossos.moe.parallel_info import MoeParallelInfo
from kolossos.moe.routers import Routing

__all__ = ["ExpertParallelMoeBlock", "FusedGatedExperts"]


class FusedGatedExperts(nn.Module):
    """This rank's experts of a Hugging Face fused-expert module (``act(x W_g) * (x W_u) W_d``).

    Args:
        gate_up_proj: the full ``[E, 2I, H]`` tensor (the block's ``experts.gate_up_proj``).
        down_proj: the full ``[E, H, I]`` tensor.
        act_fn: the activation (the HF module's ``act_fn``).
        info: the expert-parallel layout; this rank keeps experts ``info.local_experts(E)``.

    Raises:
        ValueError: ``E`` is not a multiple of ``info.ep_size``.
    """

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        info: MoeParallelInfo,
    ) -> None:
        super().__init__()
        total = int(gate_up_proj.shape[0])
        local = info.local_experts(total)
        rows = slice(local.start, local.stop)
        self.gate_up_proj = nn.Parameter(gate_up_proj.detach()[rows].clone())
        self.down_proj = nn.Parameter(down_proj.detach()[rows].clone())
        for param in (self.gate_up_proj, self.down_proj):
            vars(param)["moe_info"] = info  # replicated over info.dp_group only
        self.act_fn = act_fn
        self.num_total_experts = total
        self.num_local_experts = len(local)
        self.global_indices = local
        self.moe_info = info

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``[E_local, C, H] -> [E_local, C, H]``, expert ``i`` on row block ``i``."""
        gate, up = torch.bmm(inputs, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))


class ExpertParallelMoeBlock(nn.Module):
    """A Hugging Face sparse MoE block whose experts live on the expert-parallel group.

    Args:
        block: the Hugging Face block (``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``);
            its router, experts and shared expert are taken over.
        info: the expert-parallel layout.

    Raises:
        NotImplementedError: router jitter noise (Mixtral's ``router_jitter_noise > 0``).
    """

    def __init__(self, block: nn.Module, info: MoeParallelInfo) -> None:
        super().__init__()
        hf: Any = block  # transformers' block (attributes by its documented layout)
        if float(getattr(hf, "jitter_noise", 0.0) or 0.0) > 0:
            raise NotImplementedError(
                "router_jitter_noise > 0: the expert-parallel Mixtral block does not reproduce "
                "Hugging Face's input jitter; set config.router_jitter_noise=0."
            )
        self.gate: nn.Module = hf.gate
        experts = hf.experts
        self.experts = FusedGatedExperts(
            experts.gate_up_proj, experts.down_proj, experts.act_fn, info
        )
        self.shared_expert: nn.Module | None = getattr(hf, "shared_expert", None)
        self.shared_expert_gate: nn.Module | None = getattr(hf, "shared_expert_gate", None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Same function as the Hugging Face block. COLLECTIVE over the expert-parallel group."""
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        _, weights, index = self.gate(tokens)
        zero = tokens.new_zeros(())
        routing = Routing(
            expert_index=index,
            combine_weight=weights,
            kept=torch.ones_like(index, dtype=torch.bool),
            capacity=None,
            aux_loss=zero,
            z_loss=zero,
        )
        out = run_experts(tokens, routing, self.experts).to(tokens.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(tokens))
            out = out + gate * self.shared_expert(tokens)
        return out.reshape(shape)
