"""``HybridParallelPlugin``: tensor parallelism (+ sequence parallelism) and pipeline parallelism
combined with data parallelism (DDP or ZeRO-1/2) over a ``(dp, pp, tp)`` process mesh.

The plugin is Colossal-AI's keyword surface over the hybrid engine: its arguments become a
:class:`~kolossos.hybrid.HybridParallelConfig`, and :class:`~kolossos.hybrid.HybridParallelEngine`
does the rest (mesh, tensor-parallel plan, pipeline stages, optimizers, checkpoint IO) in the
order its module documents. See ``docs/tensor_parallel.md`` and ``docs/pipeline.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.booster.plugin.dp_plugin_base import DPPluginBase, _require_process_group
from kolossos.booster.plugin.plugin_base import Boosted, Criterion, config_from_arguments
from kolossos.checkpoint_io import CheckpointIO
from kolossos.cluster import ProcessGroupMesh
from kolossos.hybrid import HybridMesh, HybridParallelConfig, HybridParallelEngine
from kolossos.interface import OptimizerWrapper
from kolossos.pipeline import PipelineStageManager

__all__ = ["HybridParallelPlugin"]


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

    Args: see :class:`~kolossos.hybrid.HybridParallelConfig` (Colossal-AI's names and
        defaults; the seven loss-scale keywords form its ``loss_scale`` policy).

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

    config_factory = HybridParallelConfig

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
        config = config_from_arguments(HybridParallelConfig, locals())
        _require_process_group(type(self).__name__)
        self.config = config
        self.engine = HybridParallelEngine(config)  # collective: builds the mesh
        super().__init__(self.engine.mesh.dp_group)

    # ------------------------------------------------------------------ facts
    @property
    def mesh(self) -> HybridMesh:
        """The ``(dp, pp, tp)`` mesh and this rank's groups."""
        return self.engine.mesh

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
    def pg_mesh(self) -> ProcessGroupMesh:
        """The :class:`~kolossos.cluster.ProcessGroupMesh` (axes ``dp``, ``pp``, ``tp``)."""
        return self.mesh.mesh

    @property
    def stage_manager(self) -> PipelineStageManager | None:
        """The :class:`~kolossos.pipeline.PipelineStageManager` (``None`` when ``pp_size=1``)."""
        pipeline = self.engine.pipeline
        return pipeline.stage_manager if pipeline is not None else None

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
        wrapped, boosted = self.engine.boost(model, inner)
        return wrapped, boosted, criterion, dataloader, lr_scheduler

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
        averaged over data parallelism. Step the optimizer afterwards. Under
        ``torch.no_grad()`` only the forwards run (evaluation; ``optimizer`` may be ``None``).

        Returns:
            ``{"loss": mean loss of the micro-batches or None, "outputs": ... or None}``;
            values only on the rank holding the last stage.

        Raises:
            TypeError: ``model`` / ``optimizer`` are not the ones ``boost`` returned.
            ValueError: ``optimizer=None`` with ZeRO outside ``torch.no_grad()`` (its reducer
                must see the backward).
        """
        return self.engine.execute_pipeline(
            data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    def get_checkpoint_io(self) -> CheckpointIO:
        return self.engine.checkpoint_io()

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[Any]:
        return self.engine.no_sync(model, optimizer)

    def __repr__(self) -> str:
        m = self.mesh
        return (
            f"HybridParallelPlugin(tp_size={m.tp_size}, pp_size={m.pp_size}, "
            f"dp_size={m.dp_size}, precision={self.config.precision!r}, "
            f"zero_stage={self.config.zero_stage})"
        )
