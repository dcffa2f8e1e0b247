"""Find the built-in plan of a model from its class."""

from __future__ import annotations

from torch import nn

from kolossos.shardformer.policies.base_policy import Policy
from kolossos.shardformer.policies.bert import BERT_CLASSES, BertPolicy
from kolossos.shardformer.policies.gpt2 import GPT2_CLASSES, GPT2Policy
from kolossos.shardformer.policies.llama import LLAMA_CLASSES, LlamaPolicy
from kolossos.shardformer.policies.mixtral import MIXTRAL_CLASSES, MIXTRAL_MOE_PLAN, MoeBlockPlan
from kolossos.shardformer.policies.opt import OPT_CLASSES, OPTPolicy
from kolossos.shardformer.policies.qwen2_moe import QWEN2_MOE_CLASSES, QWEN2_MOE_PLAN
from kolossos.shardformer.policies.vit import VIT_CLASSES, ViTPolicy

__all__ = [
    "MOE_FAMILIES",
    "SUPPORTED_FAMILIES",
    "get_autopolicy",
    "get_moe_plan",
    "supported_models",
]

SUPPORTED_FAMILIES: dict[str, tuple[type[Policy], tuple[str, ...]]] = {
    "gpt2": (GPT2Policy, GPT2_CLASSES),
    "llama": (LlamaPolicy, LLAMA_CLASSES),
    "bert": (BertPolicy, BERT_CLASSES),
    "vit": (ViTPolicy, VIT_CLASSES),
    "opt": (OPTPolicy, OPT_CLASSES),
}
"""Family name -> (policy class, transformers class names it supports)."""


def supported_models() -> str:
    """One line per family listing the supported classes."""
    return "\n".join(
        f"  {family}: {', '.join(classes)}" for family, (_, classes) in SUPPORTED_FAMILIES.items()
    )


def get_autopolicy(model: nn.Module) -> Policy:
    """The built-in :class:`Policy` for ``model``, found by its class (or a base class) name.

    Only classes defined by transformers count, so a user class that merely shares a name does
    not pick up a plan.

    Raises:
        ValueError: no built-in plan covers the model; the message lists the supported families
            and how to pass a custom plan.
    """
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("transformers."):
            continue
        for policy_cls, classes in SUPPORTED_FAMILIES.values():
            if cls.__name__ in classes:
                return policy_cls()
    raise ValueError(
        f"ShardFormer has no tensor-parallel plan for {type(model).__name__} "
        f"({type(model).__module__}). Supported model classes:\n{supported_models()}\n"
        "For any other model write a plan: subclass kolossos.shardformer.Policy and return a "
        "ModelPlan (which modules are column/row parallel, the TP regions, the head-count "
        "attributes), then pass it as ShardFormer(config).optimize(model, policy=MyPolicy()) or "
        "HybridParallelPlugin(..., custom_policy=MyPolicy()). See docs/shardformer.md."
    )


MOE_FAMILIES: dict[str, tuple[MoeBlockPlan, tuple[str, ...]]] = {
    "mixtral": (MIXTRAL_MOE_PLAN, MIXTRAL_CLASSES),
    "qwen2_moe": (QWEN2_MOE_PLAN, QWEN2_MOE_CLASSES),
}
"""Family name -> (expert-parallel plan, transformers class names it supports)."""


def get_moe_plan(model: nn.Module) -> MoeBlockPlan:
    """The expert-parallel plan (:class:`MoeBlockPlan`) of ``model``, by its class name.

    Raises:
        ValueError: no MoE plan covers the model; the message lists the supported classes.
    """
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("transformers."):
            continue
        for plan, classes in MOE_FAMILIES.values():
            if cls.__name__ in classes:
                return plan
    supported = ", ".join(c for _, classes in MOE_FAMILIES.values() for c in classes)
    raise ValueError(
        f"no expert-parallel plan for {type(model).__name__} ({type(model).__module__}); "
        f"MoeHybridParallelPlugin supports {supported}. For another model use "
        "kolossos.moe.MoeLayer / Experts in it directly."
    )
