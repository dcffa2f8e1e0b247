"""``HybridParallelConfig``: the validated configuration of the hybrid engine, i.e. the
arguments of :class:`~kolossos.booster.plugin.HybridParallelPlugin`.

Every keyword of Colossal-AI's ``HybridParallelPlugin`` is a field here with the same name and
default, except the seven loss-scale keywords, which form one ``loss_scale`` policy. Validation
needs no process group (it runs before any collective); the checks that need the world size live
in :func:`check_world`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from kolossos.amp import LossScalePolicy
from kolossos.ddp import TorchDDPConfig
from kolossos.pipeline.schedule import check_num_chunks, schedule_names
from kolossos.shardformer.grad_ckpt_config import (
    GradientCheckpointConfig,
    PipelineGradientCheckpointConfig,
)
from kolossos.utils.checks import check_flags
from kolossos.zero.low_level.options import COMM_DTYPES

__all__ = [
    "PRECISIONS",
    "SP_MODES",
    "HybridParallelConfig",
    "check_world",
]

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: sequence-parallel modes of Colossal-AI
SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")

_BOOLS = (
    "enable_all_optimization",
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_jit_fused",
    "enable_sequence_parallelism",
    "enable_sequence_overlap",
    "parallel_output",
    "broadcast_buffers",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "cpu_offload",
    "overlap_communication",
    "enable_metadata_cache",
    "dp_outside",
    "overlap_p2p",
    "overlap_allgather",
)


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name}={value!r} must be an int >= 1{none}.")


def _positive_number(name: str, value: Any, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} must be a positive, finite number, e.g. {example}.")


@dataclass(frozen=True, kw_only=True)
class HybridParallelConfig:
    """The arguments of :class:`~kolossos.booster.plugin.HybridParallelPlugin` (Colossal-AI's
    names and defaults), validated. Options for a part that is not in use (DDP options under
    ZeRO, pipeline options with ``pp_size=1``) are validated and otherwise have no effect."""

    tp_size: int
    """Tensor-parallel size (1: no tensor parallelism)."""
    pp_size: int = 1
    """Pipeline stages (1: none)."""
    sp_size: int | None = None
    """Sequence-parallel size of the ``'all_to_all'`` / ``'ring_attn'`` modes: a mesh axis of
    ``sp_size`` ranks carved out of the data-parallel ones (``dp_size = world / (tp·pp·sp)``);
    ``split_gather`` uses the TP group, so only ``None`` or 1 is accepted there."""
    precision: str = "fp16"
    """``'fp16'`` (dynamic loss scale, fp32 masters), ``'bf16'`` (fp32 masters) or ``'fp32'``."""
    zero_stage: int = 0
    """0: DDP over the data-parallel axis; 1/2: LowLevelZero over it."""
    enable_all_optimization: bool = False
    """Switch on every ShardFormer optimisation (fused norm, flash attention, JIT)."""
    enable_fused_normalization: bool = False
    """ShardFormer: fused norms (RMSNorm → ``torch.nn.functional.rms_norm``; ``nn.LayerNorm``
    already is one fused kernel)."""
    enable_flash_attention: bool = False
    """ShardFormer: attention through PyTorch SDPA (its fastest kernel on the device)."""
    enable_jit_fused: bool = False
    """ShardFormer: fused dropout + residual add in the blocks."""
    enable_sequence_parallelism: bool = False
    """Megatron sequence parallelism (activations outside attention/MLP split along the
    sequence over the TP group)."""
    sequence_parallelism_mode: str | None = "split_gather"
    """``'split_gather'`` (Megatron SP over the TP group), ``'ring'`` (the same sharding, its
    gather / reduce-scatter done as rings of exchanges overlapped with the matmuls), or over the
    ``sp_size`` axis ``'all_to_all'`` (Ulysses) and ``'ring_attn'`` (ring attention, zig-zag
    shards)."""
    enable_sequence_overlap: bool = False
    """ShardFormer: overlap SP communication with computation."""
    parallel_output: bool = True
    """Keep the LM-head output split over the vocabulary (vocab-parallel cross-entropy)."""
    num_microbatches: int | None = None
    """Pipeline micro-batches per step (``pp_size > 1``)."""
    microbatch_size: int | None = None
    """Pipeline micro-batch size (``pp_size > 1``; ``num_microbatches`` wins when both given)."""
    loss_scale: LossScalePolicy = field(default_factory=LossScalePolicy)
    """The fp16 loss-scale policy (Colossal-AI's seven keywords, ``initial_scale=2**16`` ...)."""
    max_norm: float = 0
    """Clip gradients to this global norm (over all TP shards) at every step; 0: off."""
    broadcast_buffers: bool = True
    """DDP (zero_stage 0): broadcast buffers from the first data-parallel rank."""
    ddp_bucket_cap_mb: float = 25
    """DDP gradient bucket size in MiB."""
    find_unused_parameters: bool = False
    """DDP: look for parameters without gradients every step."""
    check_reduction: bool = False
    """DDP: accepted for compatibility (deprecated upstream)."""
    gradient_as_bucket_view: bool = False
    """DDP: gradients alias the communication buckets."""
    static_graph: bool = False
    """DDP: the graph never changes."""
    zero_bucket_size_in_m: float = 12
    """ZeRO gradient bucket size in millions (2**20) of elements."""
    cpu_offload: bool = False
    """ZeRO: fp32 masters, gradient partitions and optimizer states on the CPU."""
    communication_dtype: torch.dtype | None = None
    """ZeRO: dtype gradients are reduced in (default: the working dtype)."""
    overlap_communication: bool = True
    """ZeRO: reduce gradient buckets while backward continues (DDP always overlaps)."""
    custom_policy: Any = None
    """A ShardFormer policy used instead of the automatic one for the model's family."""
    pp_style: str = "1f1b"
    """Pipeline schedule (``pp_size > 1``): any registered one — Colossal-AI's ``'1f1b'``,
    ``'interleaved'``, ``'zbv'``, and ``'gpipe'``, ``'zbh1'``
    (:mod:`kolossos.pipeline.schedule.registry`)."""
    num_model_chunks: int = 1
    """Model chunks per stage (interleaved schedules)."""
    num_layers_per_stage: list[int] | None = None
    """Explicit layer counts per pipeline stage."""
    gradient_checkpoint_config: GradientCheckpointConfig | None = None
    """Recompute the activations of the first blocks of the model (of every pipeline stage
    with ``pp_size > 1``): ``GradientCheckpointConfig(gradient_checkpointing_ratio=...)`` or
    ``PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[...])``."""
    enable_metadata_cache: bool = True
    """Pipeline: cache the shapes of the tensors sent between stages."""
    make_vocab_size_divisible_by: int = 64
    """Pad the vocabulary (embedding and LM head) to a multiple of this times ``tp_size``."""
    dp_outside: bool = True
    """Mesh order (dp, pp, tp) when True, (pp, dp, tp) when False."""
    overlap_p2p: bool = True
    """Pipeline: overlap point-to-point communication."""
    overlap_allgather: bool = False
    """ZeRO: gather the updated parameters asynchronously after the step, bucket by bucket;
    each module's forward pre-hook waits for its own parameters (``zero_stage`` 1/2)."""

    def __post_init__(self) -> None:
        _positive_int("tp_size", self.tp_size)
        _positive_int("pp_size", self.pp_size)
        check_flags(self, _BOOLS)
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} must be one of {sorted(PRECISIONS)} "
                "(HybridParallelPlugin controls precision; do not pass Booster(mixed_precision=))."
            )
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2):
            raise ValueError(
                f"zero_stage={self.zero_stage!r} must be 0 (DDP), 1 or 2 (ZeRO over the "
                "data-parallel axis); for ZeRO-3 use GeminiPlugin or TorchFSDPPlugin."
            )
        self._check_sequence_parallel()
        self._check_pipeline()
        self._check_numbers()
        self._check_data_parallel()
        self._check_checkpointing()

    def _check_sequence_parallel(self) -> None:
        mode = self.sequence_parallelism_mode
        _positive_int("sp_size", self.sp_size, allow_none=True)
        if mode is not None and mode not in SP_MODES:
            raise ValueError(f"sequence_parallelism_mode={mode!r} must be one of {SP_MODES}.")
        if not self.enable_sequence_parallelism:
            if self.sp_size not in (None, 1):
                raise ValueError(
                    f"sp_size={self.sp_size!r} with enable_sequence_parallelism=False: set "
                    "enable_sequence_parallelism=True (sequence_parallelism_mode='all_to_all' "
                    "or 'ring_attn') or leave sp_size unset."
                )
            if self.enable_sequence_overlap:
                raise ValueError(
                    "enable_sequence_overlap=True with enable_sequence_parallelism=False: it "
                    "overlaps sequence-parallel communication; set enable_sequence_parallelism="
                    "True (sequence_parallelism_mode='split_gather') or leave it False."
                )
            return
        if mode in (None, "split_gather", "ring"):
            # Megatron SP over the TP group; 'ring' shards the same way and only replaces the
            # all-gather / reduce-scatter by ring exchanges overlapped with the matmuls
            name = mode or "split_gather"
            if self.sp_size not in (None, 1):
                raise ValueError(
                    f"sp_size={self.sp_size!r} with sequence_parallelism_mode={name!r}: "
                    "split-gather SP runs over the TP group; leave sp_size unset, or use "
                    "'all_to_all' / 'ring_attn' for a separate sequence-parallel axis."
                )
            if self.tp_size < 2:
                raise ValueError(
                    f"enable_sequence_parallelism=True with tp_size={self.tp_size}: {name} "
                    "sequence parallelism shards along the TP group; set tp_size >= 2 (or use "
                    "sequence_parallelism_mode='all_to_all' / 'ring_attn' with sp_size)."
                )
            if mode == "ring" and self.enable_sequence_overlap:
                raise NotImplementedError(
                    "enable_sequence_overlap=True with sequence_parallelism_mode='ring': the "
                    "ring already overlaps every exchange with a matmul; leave it False, or use "
                    "'split_gather' with it."
                )
            return
        # all_to_all / ring_attn: a separate axis of sp_size ranks carved out of data parallelism
        # (gradient_checkpoint_config with pp_size > 1: each checkpointed block replays with its
        # own micro-batch's padding-mask shard, hybrid/checkpointing.py)
        if self.enable_sequence_overlap:
            raise NotImplementedError(
                f"enable_sequence_overlap=True with sequence_parallelism_mode={mode!r}: the "
                "attention kernels already overlap what they can; leave it False."
            )

    @property
    def sp_axis_size(self) -> int:
        """Ranks on the separate sequence-parallel axis (1 unless 'all_to_all' / 'ring_attn')."""
        if self.enable_sequence_parallelism and self.sequence_parallelism_mode in (
            "all_to_all",
            "ring_attn",
        ):
            return self.sp_size or 1
        return 1

    def _check_pipeline(self) -> None:
        _positive_int("num_microbatches", self.num_microbatches, allow_none=True)
        _positive_int("microbatch_size", self.microbatch_size, allow_none=True)
        _positive_int("num_model_chunks", self.num_model_chunks)
        if self.pp_style not in schedule_names():
            raise ValueError(
                f"pp_style={self.pp_style!r} is not a pipeline schedule; choose one of "
                f"{schedule_names()} (Colossal-AI's are '1f1b', 'interleaved' and 'zbv')."
            )
        check_num_chunks(self.pp_style, self.num_model_chunks, arg="num_model_chunks")
        layers = self.num_layers_per_stage
        if layers is not None and (
            not isinstance(layers, (list, tuple))
            or not layers
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers)
        ):
            raise ValueError(
                f"num_layers_per_stage={layers!r} must be None or a list of ints >= 1."
            )
        if self.pp_size == 1:
            return
        stages = self.pp_size * self.num_model_chunks
        if layers is not None and len(layers) != stages:
            raise ValueError(
                f"num_layers_per_stage has {len(layers)} entries but pp_size * num_model_chunks "
                f"= {stages} virtual stages; give one count per virtual stage."
            )
        if self.num_microbatches is None and self.microbatch_size is None:
            raise ValueError(
                f"pp_size={self.pp_size} needs num_microbatches or microbatch_size; pass one, "
                "e.g. num_microbatches=4."
            )
        # split_gather with pp_size > 1: the stages exchange (micro-batch, S / tp, H) sequence
        # shards (hybrid/stage_sequence.py)
        if not self.overlap_p2p:
            raise NotImplementedError(
                f"overlap_p2p=False with pp_size={self.pp_size}: the pipeline's point-to-point "
                "layer always posts non-blocking sends and receives; leave overlap_p2p=True."
            )
        if self.zero_stage > 1:
            warnings.warn(
                f"zero_stage={self.zero_stage} with pp_size={self.pp_size}: ZeRO-2 reduces the "
                "gradients after every micro-batch's backward (one data-parallel reduction per "
                "micro-batch instead of one per step); zero_stage=1 is usually faster.",
                stacklevel=4,
            )

    def _check_numbers(self) -> None:
        if isinstance(self.custom_policy, (str, bytes, int, float, list, tuple, dict)):
            raise TypeError(
                f"custom_policy={self.custom_policy!r} must be None or a ShardFormer policy "
                f"object (e.g. GPT2Policy()), not a {type(self.custom_policy).__name__}."
            )
        if not isinstance(self.loss_scale, LossScalePolicy):
            raise TypeError(f"loss_scale={self.loss_scale!r} must be a LossScalePolicy.")
        clip = self.max_norm
        if (
            isinstance(clip, bool)
            or not isinstance(clip, (int, float))
            or not clip >= 0
            or not math.isfinite(clip)
        ):
            raise ValueError(f"max_norm={clip!r} must be a finite number >= 0 (0: no clipping).")
        _positive_number("ddp_bucket_cap_mb", self.ddp_bucket_cap_mb, "25")
        _positive_number("zero_bucket_size_in_m", self.zero_bucket_size_in_m, "12")
        _positive_int("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)

    def _check_data_parallel(self) -> None:
        if self.communication_dtype is not None and self.communication_dtype not in COMM_DTYPES:
            raise ValueError(
                f"communication_dtype={self.communication_dtype!r} must be None, torch.float16, "
                "torch.bfloat16 or torch.float32."
            )
        if self.overlap_allgather and self.zero_stage == 0:
            raise ValueError(
                "overlap_allgather=True with zero_stage=0: only ZeRO (zero_stage=1 or 2) gathers "
                "parameters after the step (DDP keeps them whole); set zero_stage=1 or 2, or "
                "drop overlap_allgather."
            )
        if self.zero_stage > 0:
            return
        zero_only = {
            "cpu_offload": self.cpu_offload,
            "communication_dtype": self.communication_dtype is not None,
            "overlap_communication=False": not self.overlap_communication,
        }
        for name, given in zero_only.items():
            if given:
                raise ValueError(
                    f"{name} is a ZeRO option but zero_stage=0 uses DDP; set zero_stage=1 or 2, "
                    "or drop the argument."
                )

    def _check_checkpointing(self) -> None:
        ckpt = self.gradient_checkpoint_config
        if ckpt is None:
            return
        if not isinstance(ckpt, GradientCheckpointConfig):
            raise TypeError(
                f"gradient_checkpoint_config={ckpt!r} must be None or a "
                "kolossos.shardformer.GradientCheckpointConfig / "
                "PipelineGradientCheckpointConfig, e.g. "
                "GradientCheckpointConfig(gradient_checkpointing_ratio=0.5)."
            )
        counts = (
            ckpt.num_ckpt_layers_per_stage
            if isinstance(ckpt, PipelineGradientCheckpointConfig)
            else None
        )
        stages = self.pp_size * self.num_model_chunks if self.pp_size > 1 else 1
        if counts is not None and len(counts) != stages:
            raise ValueError(
                f"gradient_checkpoint_config.num_ckpt_layers_per_stage={counts!r} has "
                f"{len(counts)} entries but pp_size={self.pp_size} x num_model_chunks="
                f"{self.num_model_chunks} gives {stages} (virtual) stages; give one count per "
                "stage."
            )

    @property
    def dtype(self) -> torch.dtype:
        """The working dtype of the model."""
        return PRECISIONS[self.precision]

    def ddp_config(self) -> TorchDDPConfig:
        """The DDP options (zero_stage 0)."""
        return TorchDDPConfig(
            broadcast_buffers=self.broadcast_buffers,
            bucket_cap_mb=self.ddp_bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            check_reduction=self.check_reduction,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
        )

    def zero_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`."""
        return {
            **self.loss_scale.as_kwargs(),
            "clip_grad_norm": float(self.max_norm),
            "reduce_bucket_size": max(1, int(self.zero_bucket_size_in_m * 2**20)),
            "communication_dtype": self.communication_dtype,
            "overlap_communication": self.overlap_communication,
            "partition_grad": self.zero_stage == 2,
            "cpu_offload": self.cpu_offload,
            "overlap_allgather": self.overlap_allgather,
        }


def check_world(config: HybridParallelConfig, world_size: int) -> int:
    """The data-parallel size for ``world_size`` processes.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``tp_size * pp_size * sp_size``.
    """
    sp = config.sp_axis_size
    model_parallel = config.tp_size * config.pp_size * sp
    if world_size % model_parallel:
        raise ValueError(
            f"the world size {world_size} is not divisible by tp_size * pp_size * sp_size = "
            f"{config.tp_size} * {config.pp_size} * {sp}; choose sizes whose product divides "
            "the number of processes."
        )
    return world_size // model_parallel
