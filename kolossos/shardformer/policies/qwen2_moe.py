"""The expert-parallel plan of Hugging Face Qwen2-MoE (``Qwen2MoeModel``,
``Qwen2MoeForCausalLM``).

Qwen2-MoE's sparse block is Mixtral's plus a shared expert (``shared_expert``, a gated MLP every
token goes through) scaled by ``sigmoid(shared_expert_gate(x))``; its router renormalises the
top-k probabilities only when ``config.norm_topk_prob``. The expert-parallel block keeps the
router and the shared expert (replicated) and spreads the routed experts. Decoder layers listed
in ``mlp_only_layers`` (or off the ``decoder_sparse_step``) hold a dense MLP and stay as they
are.
"""

from __future__ import annotations

from kolossos.shardformer.policies.mixtral import MoeBlockPlan

__all__ = ["QWEN2_MOE_CLASSES", "QWEN2_MOE_PLAN"]

QWEN2_MOE_CLASSES = ("Qwen2MoeModel", "Qwen2MoeForCausalLM")
"""The transformers classes the plan covers."""

QWEN2_MOE_PLAN = MoeBlockPlan(
    family="qwen2_moe",
    block_classes=("Qwen2MoeSparseMoeBlock",),
    experts_per_block="num_experts",
)
"""Qwen2-MoE's plan."""
