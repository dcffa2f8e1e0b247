"""``HybridParallelEngine``: the TP x PP x DP (x SP, x ZeRO) engine behind
:class:`~kolossos.booster.plugin.HybridParallelPlugin`, composed in a fixed order.

1. construction (before any model is seen): validate the world size against the config, build
   the ``(dp, pp, tp)`` mesh (a collective) and, with ``pp_size > 1``, the pipeline runtime;
2. :meth:`~HybridParallelEngine.boost`: apply the tensor-parallel plan; without pipeline
   parallelism move the sharded model to the device in the working dtype and wrap it in DDP over
   the data-parallel group (``zero_stage=0``); with it, cut this rank's stage chunks and register
   the parameters tied across stages; then re-point the user's optimizer at the sharded
   parameters (those this rank holds) and wrap it (:func:`build_optimizer`);
3. checkpoints through :class:`~kolossos.hybrid.checkpoint_io.HybridParallelCheckpointIO` (or
   its pipeline subclass), which finds each parameter's optimizer in the engine's registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.accelerator import get_accelerator
from kolossos.amp import ConstantGradScaler, DynamicGradScaler
from kolossos.hybrid.checkpoint_io import HybridParallelCheckpointIO
from kolossos.hybrid.checkpointing import checkpoint_pipeline_stages
from kolossos.hybrid.config import HybridParallelConfig, check_world
from kolossos.hybrid.mesh import HybridMesh, build_mesh
from kolossos.hybrid.model import HybridParallelModule, HybridPipelineModule
from kolossos.hybrid.optimizer import (
    HYBRID_OPTIMIZERS,
    HybridOptimizer,
    TPMixedPrecisionOptimizer,
    TPOptimizer,
)
from kolossos.hybrid.pipeline_checkpoint_io import PipelineCheckpointIO
from kolossos.hybrid.pipeline_runtime import PipelineRuntime
from kolossos.hybrid.sequence_parallel import install_stage_sequence_parallel
from kolossos.hybrid.sharding import (
    check_fresh,
    check_shard_options,
    first_names,
    repoint_optimizer,
    shard_model,
)
from kolossos.hybrid.zero_optimizer import HybridZeroOptimizer
from kolossos.interface import ModelWrapper, OptimizerWrapper, ParamOwners
from kolossos.lazy import LazyInitContext, materialize_on
from kolossos.nn.optimizer.flat_shards import check_flat_shard_safe

__all__ = ["HybridParallelEngine", "build_optimizer"]


def build_optimizer(
    inner: Optimizer,
    config: HybridParallelConfig,
    mesh: HybridMesh,
    names: nn.Module | Mapping[torch.Tensor, str],
) -> HybridOptimizer:
    """Wrap ``inner`` (already over the sharded parameters) for ``config``: LowLevelZero over
    the data-parallel axis (``zero_stage`` 1/2), fp32 masters with a dynamic (fp16) or unit
    (bf16) loss scale, or the plain TP optimizer (fp32); all clip by the whole model's norm."""
    pp_group = mesh.pp_group if config.pp_size > 1 else None
    opt: HybridOptimizer
    if config.zero_stage > 0:
        opt = HybridZeroOptimizer(
            inner,
            mesh.tp_group,
            pp_group=pp_group,
            dp_process_group=mesh.replica_group,
            **config.zero_kwargs(),
        )
    elif config.precision == "fp32":
        opt = TPOptimizer(inner, mesh.tp_group, config.max_norm, pp_group=pp_group)
    else:
        scaler = (
            DynamicGradScaler.from_policy(config.loss_scale)
            if config.precision == "fp16"
            else ConstantGradScaler(1.0)
        )
        opt = TPMixedPrecisionOptimizer(inner, scaler, mesh.tp_group, config.max_norm, pp_group)
    opt.set_param_names(names)
    return opt


class HybridParallelEngine:
    """The hybrid engine of one process (module doc).

    Args:
        config: the validated configuration.

    Raises:
        ValueError: the world size is not a multiple of ``tp_size * pp_size``.
        NotImplementedError: a ShardFormer option that is not implemented (named).
    """

    pipeline_class: type[PipelineRuntime] = PipelineRuntime
    """The pipeline runtime built with ``pp_size > 1`` (a subclass may adapt its steps)."""
    plugin_name = "HybridParallelPlugin"
    """The plugin in front of this engine (named in error messages)."""
    optimizer_types: tuple[type, ...] = HYBRID_OPTIMIZERS
    """The optimizers :meth:`boost` returns (what :meth:`execute_pipeline` accepts)."""

    def __init__(self, config: HybridParallelConfig) -> None:
        check_shard_options(config)
        dp_size = check_world(config, dist.get_world_size())
        self.config = config
        # SYNC POINT: the mesh's groups are created collectively, after all validation.
        self.mesh: HybridMesh = build_mesh(
            dp_size,
            config.pp_size,
            config.tp_size,
            config.dp_outside,
            sp_size=config.sp_axis_size,
            sp_inner=config.sequence_parallelism_mode != "ring_attn",
        )
        #: which optimizer owns each sharded parameter (read by the checkpoint IO)
        self.owners = ParamOwners()
        # the schedule is built here so a bad chunk count fails before the model is touched
        self.pipeline = self.pipeline_class(config, self.mesh) if config.pp_size > 1 else None

    def boost(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[ModelWrapper, HybridOptimizer | None]:
        """Shard ``model`` (in place) and wrap it and its optimizer (step 2 of the module doc).

        Raises:
            ValueError: the optimizer has state already or holds a tensor outside the model.
        """
        names = first_names(model)
        if optimizer is not None:
            check_fresh(optimizer, names)
            if self.config.tp_size > 1:  # tensor-parallel slices, like ZeRO's flat shards
                check_flat_shard_safe(optimizer, f"tp_size={self.config.tp_size}")
        c = self.config
        with LazyInitContext.resume(model):  # a lazy model's shards are cut on its record
            sharded = shard_model(model, c, self.mesh.tp_group, self.mesh.sp_group)
        if self.pipeline is not None:
            return self._boost_pipeline(self.pipeline, sharded, optimizer, names)
        materialize_on(sharded, get_accelerator().get_current_device())  # COLLECTIVE if lazy
        # the sequence-parallel ranks hold replicas: gradients are averaged over dp x sp
        ddp = c.ddp_config() if c.zero_stage == 0 and self.mesh.replica_size > 1 else None
        wrapped = HybridParallelModule(sharded, c.dtype, ddp, self.mesh.replica_group)
        module = wrapped.unwrap()
        if optimizer is None:
            return wrapped, None
        repoint_optimizer(optimizer, names, module)
        opt = build_optimizer(optimizer, c, self.mesh, module)
        if isinstance(opt, HybridZeroOptimizer) and c.overlap_allgather:
            opt.install_gather_hooks(module)  # forward pre-hooks wait for the step's gathers
        return wrapped, self._register(opt)

    def _boost_pipeline(
        self,
        pipeline: PipelineRuntime,
        sharded: nn.Module,
        optimizer: Optimizer | None,
        names: dict[torch.Tensor, str],
    ) -> tuple[ModelWrapper, HybridOptimizer | None]:
        """This rank's stage chunks, tied copies registered (made equal), and the optimizer
        re-pointed at (only) the parameters this rank holds."""
        chunks = pipeline.split(sharded, self.config.custom_policy)  # collective (tied groups)
        if self.config.sp_axis_size > 1:  # each stage runs on the rank's sequence shard
            install_stage_sequence_parallel(sharded, chunks)
        checkpoint_pipeline_stages(sharded, chunks, pipeline, self.config)
        # a lazy model: only this stage's (tensor-parallel) shards are computed (COLLECTIVE)
        materialize_on(chunks, get_accelerator().get_current_device())
        pipeline.check_tied_supported()
        pipeline.register_tied()  # collective of each tied group
        wrapped = HybridPipelineModule(chunks, self.config.dtype, pipeline)
        if optimizer is None:
            return wrapped, None
        repoint_optimizer(optimizer, names, sharded, keep=wrapped.chunks)
        opt = build_optimizer(optimizer, self.config, self.mesh, pipeline.names)
        if isinstance(opt, HybridZeroOptimizer) and self.config.overlap_allgather:
            opt.install_gather_hooks(wrapped.chunks)
        return wrapped, self._register(opt)

    def _register(self, opt: HybridOptimizer) -> HybridOptimizer:
        self.owners.register(opt, [p for group in opt.groups for p in group])
        return opt

    def checkpoint_io(self) -> HybridParallelCheckpointIO:
        """The checkpoint IO for models and optimizers this engine boosted."""
        mesh = self.mesh
        if self.pipeline is not None:
            return PipelineCheckpointIO(
                mesh.replica_group, mesh.tp_group, self.owners, self.pipeline
            )
        return HybridParallelCheckpointIO(mesh.replica_group, mesh.tp_group, self.owners)

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Callable[..., torch.Tensor],
        optimizer: OptimizerWrapper | None,
        return_loss: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        """One pipelined step (see ``HybridParallelPlugin.execute_pipeline``; with experts, the
        MoE optimizers reduce them in ``optimizer.step()``).

        Raises:
            TypeError: ``model`` / ``optimizer`` are not the ones :meth:`boost` returned.
            ValueError: ``optimizer=None`` with ZeRO, except forward-only under
                ``torch.no_grad()`` (its reducer must see the backward).
        """
        if not isinstance(model, HybridPipelineModule):
            raise TypeError(
                "execute_pipeline needs the model returned by booster.boost with "
                f"{self.plugin_name}(pp_size > 1), got {type(model).__name__}."
            )
        if optimizer is None and self.config.zero_stage > 0 and torch.is_grad_enabled():
            raise ValueError(
                f"execute_pipeline with zero_stage={self.config.zero_stage} needs the boosted "
                "optimizer (ZeRO collects the gradients during backward); pass optimizer=."
            )
        if optimizer is not None and not isinstance(optimizer, self.optimizer_types):
            raise TypeError(
                "execute_pipeline needs the optimizer returned by booster.boost, got "
                f"{type(optimizer).__name__}."
            )
        return model.pipeline.run(
            model.chunks, data_iter, criterion, optimizer, return_loss, return_outputs
        )

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None
    ) -> AbstractContextManager[Any]:
        """Gradient accumulation without data-parallel communication.

        Raises:
            NotImplementedError: with ``pp_size > 1`` (a step accumulates micro-batches).
            TypeError: objects ``boost`` did not return, or ZeRO without its optimizer.
        """
        if isinstance(model, HybridPipelineModule):
            raise NotImplementedError(
                "no_sync with pp_size > 1: a pipeline step already accumulates num_microbatches "
                "micro-batches; raise num_microbatches instead of accumulating steps."
            )
        if not isinstance(model, HybridParallelModule):
            raise TypeError(
                "no_sync needs the model returned by booster.boost with HybridParallelPlugin, "
                f"got {type(model).__name__}."
            )
        if isinstance(optimizer, HybridZeroOptimizer):
            return optimizer.no_sync()
        if self.config.zero_stage > 0:
            raise TypeError(
                f"no_sync with zero_stage={self.config.zero_stage} needs the optimizer returned "
                "by booster.boost: booster.no_sync(model, optimizer)."
            )
        return model.no_sync()
