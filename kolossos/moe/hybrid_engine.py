"""``MoeHybridParallelEngine``: the hybrid engine with an expert-parallel axis, behind
:class:`~kolossos.booster.plugin.MoeHybridParallelPlugin`. Composed in this order:

1. construction: validate the sizes against the world (``ep x pp x tp`` divides it), build the
   hybrid mesh (a collective), then the expert-parallel groups of consecutive ranks inside data
   parallelism and their expert data-parallel groups (``dp = ep x moe_dp``,
   :func:`~kolossos.moe.parallel_info.create_moe_groups`);
2. :meth:`~MoeHybridParallelEngine.boost`: replace the model's sparse MoE blocks by
   expert-parallel ones following the family's plan
   (:func:`~kolossos.shardformer.policies.auto_policy.get_moe_plan`), each rank keeping the
   experts of its expert-parallel position; make expert replicas equal over their expert DP
   group; move the model to the device in the working dtype and, with ``zero_stage=0``, wrap it
   in DDP over the data-parallel group with the experts ignored; wrap the optimizer so expert
   gradients are reduced over the expert DP group only (:mod:`kolossos.moe.hybrid_optimizer`);
   with ``pp_size > 1`` (Mixtral): the blocks are replaced first, then the model is cut into
   this rank's stage chunks along the family's stage layout; the runtime averages only the
   dense gradients over dp (:mod:`kolossos.moe.hybrid_pipeline`), the optimizer reduces the
   experts. The expert-parallel groups live inside each stage's data-parallel ranks;
3. checkpoints through :class:`~kolossos.moe.checkpoint_io.MoeCheckpointIO` (experts gathered
   into the Hugging Face layout, re-cut at any ``ep_size`` on load).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from kolossos.hybrid.engine import HybridParallelEngine, build_optimizer
from kolossos.hybrid.model import HybridParallelModule, HybridPipelineModule
from kolossos.hybrid.pipeline_runtime import PipelineRuntime
from kolossos.hybrid.sharding import check_fresh, first_names, repoint_optimizer
from kolossos.hybrid.zero_optimizer import HybridZeroOptimizer
from kolossos.interface import ModelWrapper, OptimizerWrapper
from kolossos.moe.checkpoint_io import MoeCheckpointIO
from kolossos.moe.hf_block import ExpertParallelMoeBlock
from kolossos.moe.hybrid_config import MoeHybridParallelConfig, check_moe_world
from kolossos.moe.hybrid_optimizer import MoeDDPOptimizer, MoeZeroOptimizer, split_expert_groups
from kolossos.moe.hybrid_pipeline import MoePipelineRuntime, create_mesh_moe_groups
from kolossos.moe.parallel_info import MoeParallelInfo
from kolossos.moe.params import is_moe_param, sync_moe_params
from kolossos.shardformer.policies.auto_policy import get_moe_plan

__all__ = ["MoeHybridParallelEngine", "replace_moe_blocks"]


def replace_moe_blocks(model: nn.Module, info: MoeParallelInfo) -> int:
    """Replace (in place) every sparse MoE block of a Hugging Face Mixtral / Qwen2-MoE model by
    an :class:`~kolossos.moe.hf_block.ExpertParallelMoeBlock` holding this rank's experts;
    returns how many blocks were replaced.

    Raises:
        ValueError: no plan covers the model, it has no MoE block, or its number of experts is
            not a multiple of ``info.ep_size``.
    """
    plan = get_moe_plan(model)
    config = getattr(model, "config", None)
    experts = getattr(config, plan.experts_per_block, None)
    if isinstance(experts, int) and experts % info.ep_size:
        raise ValueError(
            f"{plan.experts_per_block}={experts} is not divisible by ep_size={info.ep_size}: "
            "each expert-parallel rank holds num_experts / ep_size experts; choose an ep_size "
            "dividing the number of experts."
        )
    blocks = plan.blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no {plan.block_classes} module to make expert-parallel "
            "(already boosted?); pass a freshly built model."
        )
    for name, block in blocks:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, ExpertParallelMoeBlock(block, info))
    return len(blocks)


def _single_rank_group() -> dist.ProcessGroup:
    """A group of this rank alone (COLLECTIVE: every rank creates every one-rank group)."""
    mine = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            mine = group
    assert mine is not None
    return mine


def _check_pipeline_model(model: nn.Module) -> None:
    """Refuse what pipeline stages of an expert-parallel model do not do.

    Raises:
        NotImplementedError: a family without a stage plan, or ``output_router_logits=True``.
    """
    plan = get_moe_plan(model)
    if plan.stage_plan is None:
        raise NotImplementedError(
            f"pp_size > 1 with a {plan.family} model: MoeHybridParallelPlugin has no pipeline "
            "stage layout for this family (Mixtral has one); set pp_size=1."
        )
    if bool(getattr(getattr(model, "config", None), "output_router_logits", False)):
        raise NotImplementedError(
            "output_router_logits=True with pp_size > 1: Hugging Face adds the load-balancing "
            "loss of every layer's router logits on the last stage, which does not hold the "
            "earlier stages' logits; set config.output_router_logits=False (or pp_size=1)."
        )


class MoeHybridParallelEngine(HybridParallelEngine):
    """The hybrid engine of one process with expert parallelism (module doc).

    Args:
        config: the validated configuration.

    Raises:
        ValueError: ``ep_size x pp_size x tp_size`` does not divide the world size.
    """

    pipeline_class = MoePipelineRuntime
    plugin_name = "MoeHybridParallelPlugin"
    optimizer_types = (MoeDDPOptimizer, MoeZeroOptimizer)

    def __init__(self, config: MoeHybridParallelConfig) -> None:
        check_moe_world(config, dist.get_world_size())
        super().__init__(config)
        self.moe_config = config
        # SYNC POINT: the expert-parallel and expert data-parallel groups (consecutive ranks of
        # each data-parallel group; with tp = pp = 1 the data-parallel group is the world)
        self.moe_info: MoeParallelInfo = create_mesh_moe_groups(self.mesh, config.ep_size)
        group = self.moe_info.dp_group
        if group is None and config.zero_stage > 0:
            group = _single_rank_group()  # ZeRO needs a group even of one rank
        self.expert_dp_group = group

    def boost(  # type: ignore[override]
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[ModelWrapper, OptimizerWrapper | None]:
        """Make ``model`` expert-parallel (in place) and wrap it and its optimizer.

        Raises:
            ValueError: the optimizer has state already or holds a tensor outside the model;
                the model has no MoE plan or blocks.
        """
        names = first_names(model)
        if optimizer is not None:
            check_fresh(optimizer, names)
        c = self.moe_config
        if self.pipeline is not None:
            _check_pipeline_model(model)
        replace_moe_blocks(model, self.moe_info)
        sync_moe_params(model)  # COLLECTIVE over each expert DP group
        if self.pipeline is not None:
            return self._boost_moe_pipeline(self.pipeline, model, optimizer, names)
        experts = {n for n, p in model.named_parameters() if is_moe_param(p)}
        ddp = c.ddp_config() if c.zero_stage == 0 and self.mesh.replica_size > 1 else None
        if ddp is not None:  # the experts are reduced over their own group (hybrid_optimizer)
            DDP._set_params_and_buffers_to_ignore_for_model(model, sorted(experts))
        wrapped = HybridParallelModule(model, c.dtype, ddp, self.mesh.replica_group)
        module = wrapped.unwrap()
        if optimizer is None:
            return wrapped, None
        repoint_optimizer(optimizer, names, module)
        if c.zero_stage == 0:
            base = self._register(build_optimizer(optimizer, self._inner_config, self.mesh, module))
            return wrapped, self._ddp_optimizer(base, module, None)
        return wrapped, self._zero_optimizer(optimizer, module)

    @property
    def _inner_config(self) -> MoeHybridParallelConfig:
        """The configuration of the inner optimizers: no clipping of their own (the MoE
        optimizers clip by the norm over dense and expert gradients)."""
        return dataclasses.replace(self.moe_config, max_norm=0.0)

    def _ddp_optimizer(
        self, base: Any, module: nn.Module, pp_group: dist.ProcessGroup | None
    ) -> MoeDDPOptimizer:
        experts = [p for p in module.parameters() if is_moe_param(p)]
        return MoeDDPOptimizer(
            base, experts, self.moe_info.dp_group, self.mesh.replica_size,
            ep_group=self.moe_info.ep_group, max_norm=self.moe_config.max_norm,
            pp_group=pp_group,
        )  # fmt: skip

    def _boost_moe_pipeline(
        self,
        pipeline: PipelineRuntime,
        model: nn.Module,
        optimizer: Optimizer | None,
        names: dict[torch.Tensor, str],
    ) -> tuple[ModelWrapper, OptimizerWrapper | None]:
        """This rank's stage chunks of the expert-parallel ``model`` and its optimizer over
        (only) the parameters this rank holds."""
        stage_plan = get_moe_plan(model).stage_plan
        assert stage_plan is not None  # checked by _check_pipeline_model
        chunks = pipeline.split(model, stage_plan(model))  # collective (tied groups)
        pipeline.check_tied_supported()
        pipeline.register_tied()  # collective of each tied group
        wrapped = HybridPipelineModule(chunks, self.moe_config.dtype, pipeline)
        if optimizer is None:
            return wrapped, None
        repoint_optimizer(optimizer, names, model, keep=wrapped.chunks)
        if self.moe_config.zero_stage > 0:
            return wrapped, self._zero_optimizer(optimizer, pipeline.names, self.mesh.pp_group)
        config, names = self._inner_config, pipeline.names
        base = self._register(build_optimizer(optimizer, config, self.mesh, names))
        return wrapped, self._ddp_optimizer(base, wrapped.chunks, self.mesh.pp_group)

    def _zero_optimizer(
        self,
        optimizer: Optimizer,
        module: nn.Module | Mapping[torch.Tensor, str],
        pp_group: dist.ProcessGroup | None = None,
    ) -> MoeZeroOptimizer:
        """Dense ZeRO over the data-parallel group, expert ZeRO over the expert DP group
        (``module``: the model, or the names of a stage's parameters)."""
        c = self.moe_config
        expert_inner, origin = split_expert_groups(optimizer, is_moe_param)
        if expert_inner is None:
            raise ValueError(
                "the optimizer holds no expert parameter: pass an optimizer over all the "
                "model's parameters (model.parameters())."
            )
        inner = self._inner_config
        dense = build_optimizer(optimizer, inner, self.mesh, module)
        assert isinstance(dense, HybridZeroOptimizer)
        expert = HybridZeroOptimizer(
            expert_inner,
            self.mesh.tp_group,
            dp_process_group=self.expert_dp_group,
            **inner.zero_kwargs(),
        )
        expert.set_param_names(module)
        self._register(dense)
        self._register(expert)
        return MoeZeroOptimizer(
            dense, expert, origin, ep_group=self.moe_info.ep_group, max_norm=c.max_norm,
            pp_group=pp_group,
        )  # fmt: skip

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None
    ) -> AbstractContextManager[Any]:
        """Gradient accumulation without data-parallel communication (see the hybrid
        engine's); with ZeRO both partitions accumulate locally."""
        if isinstance(optimizer, MoeZeroOptimizer):
            return optimizer.no_sync()
        return super().no_sync(model, optimizer)

    def checkpoint_io(self) -> MoeCheckpointIO:
        """Checkpoint IO writing experts in the Hugging Face layout."""
        mesh = self.mesh
        pipelined = self.pipeline is not None
        return MoeCheckpointIO(
            mesh.replica_group, mesh.tp_group, self.owners, self.moe_info, pipelined
        )
