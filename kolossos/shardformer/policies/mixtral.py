"""The expert-parallel plan of Hugging Face Mixtral (``MixtralModel``, ``MixtralForCausalLM``).

A MoE plan says which modules are the sparse MoE blocks to replace by an expert-parallel block
(:class:`~kolossos.moe.hf_block.ExpertParallelMoeBlock`, applied by the MoE engine); everything
else (attention, norms, embeddings, the LM head) stays replicated. Mixtral's block holds the
router as ``gate`` (``MixtralTopKRouter``: softmax, top-k, renormalised) and the experts as the
fused tensors ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` (the layout
of transformers 5.x).

For pipeline parallelism the plan also gives the model's :class:`StageLayout` (embeddings and
rotary embedding on the first stage, ``model.layers`` split over the stages, the final norm and
``lm_head`` on the last), as LLaMA's plan does; no layer is tensor-parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from kolossos.shardformer.policies._common import find_base, head_paths, is_class
from kolossos.shardformer.policies.base_policy import BlockPlan, ModelPlan, StageLayout

__all__ = ["MIXTRAL_CLASSES", "MIXTRAL_MOE_PLAN", "MoeBlockPlan", "mixtral_stage_plan"]

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
    stage_plan: Callable[[nn.Module], ModelPlan] | None = None
    """The model's pipeline plan (stage layout, nothing tensor-parallel); ``None``: the family
    has none (pipeline parallelism is refused)."""

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(qualified name, block)`` of every sparse MoE block of ``model``, in order."""
        return [
            (name, module)
            for name, module in model.named_modules()
            if type(module).__name__ in self.block_classes
        ]


def mixtral_stage_plan(model: nn.Module) -> ModelPlan:
    """The pipeline plan of a Mixtral model: its stage layout, no tensor-parallel layer.

    Raises:
        ValueError: ``model`` is neither a ``MixtralModel`` nor holds one as ``model``.
    """
    _, prefix = find_base(model, "MixtralModel", "model")
    is_lm = is_class(model, "MixtralForCausalLM")
    return ModelPlan(
        family="mixtral",
        layout=StageLayout(
            embeddings=(prefix + "embed_tokens", prefix + "rotary_emb"),
            blocks=prefix + "layers",
            final=(prefix + "norm", *head_paths(model, ("lm_head",))),
            tied=((prefix + "embed_tokens.weight", "lm_head.weight"),) if is_lm else (),
        ),
        block=BlockPlan(layers=()),
        causal_lm_loss=is_lm,
        notes=("replicated: attention, norms, router; experts: expert-parallel blocks",),
    )


MIXTRAL_MOE_PLAN = MoeBlockPlan(
    family="mixtral",
    block_classes=("MixtralSparseMoeBlock",),
    experts_per_block="num_local_experts",
    stage_plan=mixtral_stage_plan,
)
"""Mixtral's plan."""
