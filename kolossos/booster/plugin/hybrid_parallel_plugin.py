"""``HybridParallelPlugin``: tensor parallelism (+ sequence parallelism) and pipeline parallelism
combined with data parallelism (DDP or ZeRO-1/2) over a ``(dp, pp, tp)`` process mesh.

The recipe (the pieces live in :mod:`kolossos.booster.plugin.hybrid`, the layers in
:mod:`kolossos.nn.layer.parallel_1d`, the plans in :mod:`kolossos.shardformer`):

1. validate the arguments into a :class:`~kolossos.booster.plugin.hybrid.HybridParallelConfig`
   (before any collective) and build the mesh;
2. at ``boost``: apply the plan (``ShardFormer(...).optimize(model, policy=custom_policy)``),
   move the sharded model to the device in the working dtype, wrap it in DDP over the
   data-parallel group (``zero_stage=0``);
3. re-point the user's optimizer at the sharded parameters and wrap it: fp32 / mixed precision
   with fp32 masters (``zero_stage=0``) or LowLevelZero over the data-parallel group (1/2), all
   summing the sequence-parallel gradients over TP and clipping by the whole model's norm;
4. checkpoints through
   :class:`~kolossos.checkpoint_io.hybrid_parallel_checkpoint_io.HybridParallelCheckpointIO`.

With ``pp_size > 1``, step 2 also cuts the sharded model into this rank's stage chunks along the
plan's stage layout and no DDP is used; ``execute_pipeline`` runs the schedule
(:mod:`kolossos.booster.plugin.hybrid.pipeline`), and checkpoints go through
:class:`~kolossos.booster.plugin.hybrid.pipeline_checkpoint_io.PipelineCheckpointIO`.

See ``docs/tensor_parallel.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from torch.utils.weak import WeakIdKeyDictionary

from kolossos.amp import ConstantGradScaler, DynamicGradScaler
from kolossos.booster.plugin.dp_plugin_base import DPPluginBase, _require_process_group
from kolossos.booster.plugin.hybrid import (
    HybridMesh,
    HybridParallelConfig,
    HybridParallelModule,
    HybridPipelineModule,
    HybridZeroOptimizer,
    TPMixedPrecisionOptimizer,
    TPOptimizer,
    build_mesh,
    check_world,
)
from kolossos.booster.plugin.hybrid.pipeline import PipelineRuntime
from kolossos.booster.plugin.hybrid.sharding import (
    check_fresh,
    check_shard_options,
    first_names,
    repoint_optimizer,
    shard_model,
)
from kolossos.booster.plugin.plugin_base import Boosted, Criterion
from kolossos.booster.plugin.torch_ddp_plugin import TorchDDPConfig
from kolossos.interface import OptimizerWrapper
from kolossos.zero.low_level.low_level_optim import zero_optimizer_of

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO

__all__ = ["HybridParallelPlugin"]

HybridOptimizer = TPOptimizer | TPMixedPrecisionOptimizer | HybridZeroOptimizer


class HybridParallelPlugin(DPPluginBase):
    """Tensor parallelism (Megatron 1D, optionally with sequence parallelism) on the last mesh
    axis, data parallelism (DDP, or ZeRO-1/2 with ``zero_stage``) on the first.

    ``dp_size = world_size / (tp_size * pp_size)``. The model is sharded by ShardFormer's plan
    for its family (GPT-2, LLaMA, BERT, ViT, OPT) or by ``custom_policy``. Precision is the
    plugin's business (``precision=``), do not pass ``Booster(mixed_precision=...)``.
    ``prepare_dataloader`` gives the ranks of one TP group (and one pipeline) the same data.
    With ``pp_size > 1`` each rank holds its stages' layers and a training step is
    ``booster.execute_pipeline(data_iter, model, criterion, optimizer)`` with the schedule
    ``pp_style`` (``'1f1b'``, ``'interleaved'`` with ``num_model_chunks``, ``'zbv'``).

    Args: see :class:`~kolossos.booster.plugin.hybrid.HybridParallelConfig` (Colossal-AI's names
        and defaults).

    Raises:
        ValueError / TypeError: a bad argument, or sizes that do not divide the world size.
        NotImplementedError: an option this implementation does not provide (named).

    Example:
        >>> plugin = HybridParallelPlugin(tp_size=2, zero_stage=1, precision="bf16")
        ... # doctest: +SKIP
        >>> booster = Booster(plugin=plugin)  # doctest: +SKIP
        >>> model, optimizer, _, loader, _ = booster.boost(model, optimizer, dataloader=loader)
        ... # doctest: +SKIP
    """

    def __init__(
        self,
        tp_size: int,
        pp_size: int = 1,
        sp_size: int | None = None,
        precision: str = "fp16",
        zero_stage: int = 0,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_jit_fused: bool = False,
        enable_sequence_parallelism: bool = False,
        sequence_parallelism_mode: str | None = "split_gather",
        enable_sequence_overlap: bool = False,
        parallel_output: bool = True,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0,
        broadcast_buffers: bool = True,
        ddp_bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        zero_bucket_size_in_m: float = 12,
        cpu_offload: bool = False,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        custom_policy: Any = None,
        pp_style: str = "1f1b",
        num_model_chunks: int = 1,
        num_layers_per_stage: list[int] | None = None,
        gradient_checkpoint_config: Any = None,
        enable_metadata_cache: bool = True,
        make_vocab_size_divisible_by: int = 64,
        dp_outside: bool = True,
        overlap_p2p: bool = True,
        overlap_allgather: bool = False,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.config = HybridParallelConfig(**arguments)
        check_shard_options(self.config)
        _require_process_group(type(self).__name__)
        dp_size = check_world(self.config, dist.get_world_size())
        c = self.config
        # SYNC POINT: the mesh's groups are created collectively, after all validation.
        self.mesh: HybridMesh = build_mesh(dp_size, c.pp_size, c.tp_size, c.dp_outside)
        super().__init__(self.mesh.dp_group)
        self._owners: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> ref to its optimizer
        # the schedule is built here so a bad chunk count fails before the model is touched
        self.pipeline = PipelineRuntime(c, self.mesh) if c.pp_size > 1 else None

    # ------------------------------------------------------------------ facts
    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return self.config.tp_size

    @property
    def pp_size(self) -> int:
        """Pipeline size."""
        return self.config.pp_size

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """This rank's tensor-parallel group."""
        return self.mesh.tp_group

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """This rank's pipeline group."""
        return self.mesh.pp_group

    @property
    def pg_mesh(self) -> Any:
        """The :class:`~kolossos.cluster.ProcessGroupMesh` (axes ``dp``, ``pp``, ``tp``)."""
        return self.mesh.mesh

    @property
    def stage_manager(self) -> Any:
        """The :class:`~kolossos.pipeline.PipelineStageManager` (``None`` when ``pp_size=1``)."""
        return self.pipeline.stage_manager if self.pipeline is not None else None

    def support_pipeline(self) -> bool:
        return self.config.pp_size > 1

    def supported_precisions(self) -> list[str]:
        return ["fp16", "bf16", "fp32"]

    def control_precision(self) -> bool:
        return True

    # ------------------------------------------------------------------ boosting
    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
        names = first_names(model)
        if inner is not None:
            check_fresh(inner, names)
        c = self.config
        sharded = shard_model(model, c, self.tp_group)
        if self.pipeline is not None:
            return self._configure_pipeline(
                sharded, inner, names, criterion, dataloader, lr_scheduler
            )
        use_ddp = c.zero_stage == 0 and self.dp_size > 1
        ddp = TorchDDPConfig(**c.ddp_kwargs()) if use_ddp else None
        wrapped = HybridParallelModule(sharded, c.dtype, ddp, self.dp_group)
        module = wrapped.unwrap()
        boosted: HybridOptimizer | None = None
        if inner is not None:
            repoint_optimizer(inner, names, module)
            boosted = self._wrap_optimizer(inner, module)
        return wrapped, boosted, criterion, dataloader, lr_scheduler

    def _configure_pipeline(
        self,
        sharded: nn.Module,
        inner: Optimizer | None,
        names: dict[torch.Tensor, str],
        criterion: Criterion | None,
        dataloader: DataLoader[Any] | None,
        lr_scheduler: LRScheduler | None,
    ) -> Boosted:
        """``pp_size > 1``: this rank's stage chunks, tied copies made equal, and the optimizer
        re-pointed at (only) the parameters this rank holds."""
        pipeline = self.pipeline
        assert pipeline is not None
        chunks = pipeline.split(sharded, self.config.custom_policy)  # collective (tied groups)
        pipeline.check_tied_supported()
        pipeline.broadcast_tied()
        wrapped = HybridPipelineModule(chunks, self.config.dtype, pipeline)
        boosted: HybridOptimizer | None = None
        if inner is not None:
            repoint_optimizer(inner, names, sharded)
            local = set(wrapped.chunks.parameters())
            for group in inner.param_groups:
                group["params"] = [p for p in group["params"] if p in local]
            boosted = self._wrap_optimizer(inner, pipeline.names)
        return wrapped, boosted, criterion, dataloader, lr_scheduler

    def _wrap_optimizer(
        self, inner: Optimizer, module: nn.Module | dict[torch.Tensor, str]
    ) -> HybridOptimizer:
        c = self.config
        pp_group = self.pp_group if c.pp_size > 1 else None
        opt: HybridOptimizer
        if c.zero_stage > 0:
            opt = HybridZeroOptimizer(
                inner,
                self.tp_group,
                pp_group=pp_group,
                dp_process_group=self.dp_group,
                **c.zero_kwargs(),
            )
        elif c.precision == "fp32":
            opt = TPOptimizer(inner, self.tp_group, c.max_norm, pp_group=pp_group)
        else:
            scaler = (
                DynamicGradScaler(**c.scaler_kwargs())
                if c.precision == "fp16"
                else ConstantGradScaler(1.0)
            )
            opt = TPMixedPrecisionOptimizer(inner, scaler, self.tp_group, c.max_norm, pp_group)
        opt.set_param_names(module)
        if not isinstance(opt, HybridZeroOptimizer):  # ZeRO registers its own parameters
            for param in opt.working_params():
                self._owners[param] = weakref.ref(opt)
        return opt

    def _owner_of(self, tensor: torch.Tensor) -> Any:
        ref = self._owners.get(tensor)
        owner = ref() if ref is not None else None
        return owner if owner is not None else zero_optimizer_of(tensor)

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Criterion,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """One training step over ``num_microbatches`` micro-batches of ``next(data_iter)``:
        forward and backward by the schedule, tied gradients summed over the stages, gradients
        averaged over data parallelism. Step the optimizer afterwards.

        Returns:
            ``{"loss": mean loss of the micro-batches or None, "outputs": ... or None}``;
            values only on the rank holding the last stage.

        Raises:
            TypeError: ``model`` / ``optimizer`` are not the ones ``boost`` returned.
            ValueError: ``optimizer=None`` with ZeRO (its reducer must see the backward).
        """
        if not isinstance(model, HybridPipelineModule):
            raise TypeError(
                "execute_pipeline needs the model returned by booster.boost with "
                f"HybridParallelPlugin(pp_size > 1), got {type(model).__name__}."
            )
        if optimizer is None and self.config.zero_stage > 0:
            raise ValueError(
                f"execute_pipeline with zero_stage={self.config.zero_stage} needs the boosted "
                "optimizer (ZeRO collects the gradients during backward); pass optimizer=."
            )
        if optimizer is not None and not isinstance(
            optimizer, (TPOptimizer, TPMixedPrecisionOptimizer, HybridZeroOptimizer)
        ):
            raise TypeError(
                "execute_pipeline needs the optimizer returned by booster.boost, got "
                f"{type(optimizer).__name__}."
            )
        return model.pipeline.run(
            model.chunks, data_iter, criterion, optimizer, return_loss, return_outputs
        )

    def get_checkpoint_io(self) -> CheckpointIO:
        from kolossos.checkpoint_io.hybrid_parallel_checkpoint_io import (
            HybridParallelCheckpointIO,
        )

        if self.pipeline is not None:
            from kolossos.booster.plugin.hybrid.pipeline_checkpoint_io import (
                PipelineCheckpointIO,
            )

            return PipelineCheckpointIO(self.dp_group, self.tp_group, self._owner_of, self.pipeline)
        return HybridParallelCheckpointIO(self.dp_group, self.tp_group, self._owner_of)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[Any]:
        if isinstance(model, HybridPipelineModule):
            raise NotImplementedError(
                "no_sync with pp_size > 1: a pipeline step already accumulates num_microbatches "
                "micro-batches; raise num_microbatches instead of accumulating steps."
            )
        if not isinstance(model, HybridParallelModule):
            raise TypeError(
                f"no_sync needs the model returned by booster.boost with {self.name}, got "
                f"{type(model).__name__}."
            )
        if isinstance(optimizer, HybridZeroOptimizer):
            return optimizer.no_sync()
        if self.config.zero_stage > 0:
            raise TypeError(
                f"no_sync with zero_stage={self.config.zero_stage} needs the optimizer returned "
                "by booster.boost: booster.no_sync(model, optimizer)."
            )
        return model.no_sync()

    def __repr__(self) -> str:
        m = self.mesh
        return (
            f"HybridParallelPlugin(tp_size={m.tp_size}, pp_size={m.pp_size}, "
            f"dp_size={m.dp_size}, precision={self.config.precision!r}, "
            f"zero_stage={self.config.zero_stage})"
        )
