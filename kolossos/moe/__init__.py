"""Mixture of experts with expert parallelism (Colossal-AI's ``colossalai.nn.layer.moe`` /
``colossalai.moe``): routers, stacked experts, the MoE layer and its all-to-all, the
expert-parallel groups and the auxiliary losses. See ``docs/moe.md``."""

from kolossos.moe.context import MOE_CONTEXT, MoeContext, moe_set_seed
from kolossos.moe.dispatch import run_experts
from kolossos.moe.experts import Experts
from kolossos.moe.grad_norm import ExpertParallelGradNorm, expert_parallel_grad_norm
from kolossos.moe.layer import MoeLayer
from kolossos.moe.loss import MoeCrossEntropyLoss, MoeLoss
from kolossos.moe.noise import NormalNoiseGenerator, UniformNoiseGenerator
from kolossos.moe.parallel_info import (
    MoeParallelInfo,
    create_moe_groups,
    moe_group_ranks,
    single_process_info,
)
from kolossos.moe.params import is_moe_param, moe_info_of, sync_moe_params
from kolossos.moe.routers import MoeRouter, Routing, Top1Router, Top2Router, TopKRouter

__all__ = [
    "MOE_CONTEXT",
    "ExpertParallelGradNorm",
    "Experts",
    "MoeContext",
    "MoeCrossEntropyLoss",
    "MoeLayer",
    "MoeLoss",
    "MoeParallelInfo",
    "MoeRouter",
    "NormalNoiseGenerator",
    "Routing",
    "Top1Router",
    "Top2Router",
    "TopKRouter",
    "UniformNoiseGenerator",
    "create_moe_groups",
    "expert_parallel_grad_norm",
    "is_moe_param",
    "moe_group_ranks",
    "moe_info_of",
    "moe_set_seed",
    "run_experts",
    "single_process_info",
    "sync_moe_params",
]
