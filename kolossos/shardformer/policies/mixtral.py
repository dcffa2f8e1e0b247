"""The expert-parallel plan of Hugging Face Mixtral (``MixtralModel``, ``MixtralForCausalLM``).

A MoE plan says which modules are the sparse MoE blocks to replace by an expert-parallel block
(:class:`~kolossos.moe.hf_block.ExpertParallelMoeBlock`, applied by the MoE engine); everything
else (attention, norms, embeddings, the LM head) stays replicated. Mixtral's block holds the
router as ``gate`` (``MixtralTopKRouter``: softmax, top-k, renormalised) and the experts as the
fused tensors ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` (the layout
of transformers 5.x).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["MIXTRAL_CLASSES", "MIXTRAL_MOE_PLAN", "MoeBlockPlan"]

MIXTRAL_CLASSES = ("MixtralModel", "MixtralForCausalLM")
"""The transformers classes the plan covers."""


@dataclass(frozen=True, kw_only=True)
class MoeBlockPlan:
    """Which modules of a model family are sparse MoE blocks with fused experts."""

    family: str
    """The family name (for messages)."""
    block_classes: tuple[str, ...]
    """Class names of the sparse MoE blocks to replace."""
    experts_per_block: str
    """The model config attribute holding the number of experts."""

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(qualified name, block)`` of every sparse MoE block of ``model``, in order."""
        return [
            (name, module)
            for name, module in model.named_modules()
            if type(module).__name__ in self.block_classes
        ]


MIXTRAL_MOE_PLAN = MoeBlockPlan(
    family="mixtral",
    block_classes=("MixtralSparseMoeBlock",),
    experts_per_block="num_local_experts",
)
"""Mixtral's plan."""
