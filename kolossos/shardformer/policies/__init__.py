"""Tensor-parallel plans: the declarative types and the built-in families."""

from kolossos.shardformer.policies.auto_policy import (
    SUPPORTED_FAMILIES,
    get_autopolicy,
    supported_models,
)
from kolossos.shardformer.policies.base_policy import (
    BlockPlan,
    Divisible,
    LocalAttribute,
    ModelPlan,
    ParallelLayer,
    Policy,
    SequenceBoundary,
    StageLayout,
    TPRegion,
)
from kolossos.shardformer.policies.bert import BertPolicy
from kolossos.shardformer.policies.gpt2 import GPT2Policy
from kolossos.shardformer.policies.llama import LlamaPolicy
from kolossos.shardformer.policies.opt import OPTPolicy
from kolossos.shardformer.policies.vit import ViTPolicy

__all__ = [
    "SUPPORTED_FAMILIES",
    "BertPolicy",
    "BlockPlan",
    "Divisible",
    "GPT2Policy",
    "LlamaPolicy",
    "LocalAttribute",
    "ModelPlan",
    "OPTPolicy",
    "ParallelLayer",
    "Policy",
    "SequenceBoundary",
    "StageLayout",
    "TPRegion",
    "ViTPolicy",
    "get_autopolicy",
    "supported_models",
]
