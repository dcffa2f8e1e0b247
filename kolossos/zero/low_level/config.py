"""``LowLevelZeroConfig``: the validated arguments of
:class:`~kolossos.booster.plugin.LowLevelZeroPlugin` (ZeRO-1/2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kolossos.amp import LossScalePolicy
from kolossos.utils.checks import check_flags
from kolossos.zero.low_level.options import COMM_DTYPES, check_norm_type

__all__ = ["PRECISIONS", "LowLevelZeroConfig"]

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class LowLevelZeroConfig:
    """ZeRO stage, precision, loss scale, clipping and communication options.

    Example:
        >>> LowLevelZeroConfig(stage=2, precision="bf16").optimizer_kwargs()["partition_grad"]
        True
    """

    stage: int = 1
    """1: shard optimizer states; 2: also shard gradients."""
    precision: str = "fp16"
    """Working dtype of the model: ``'fp16'`` (with a dynamic loss scale), ``'bf16'``, ``'fp32'``;
    fp16/bf16 keep fp32 master weights in the optimizer."""
    loss_scale: LossScalePolicy = field(
        default_factory=lambda: LossScalePolicy(initial_scale=2**32)
    )
    """The fp16 loss-scale policy (Colossal-AI's LowLevelZeroPlugin starts at ``2**32``)."""
    max_norm: float = 0.0
    """Clip gradients to this global norm at every step (0: no clipping)."""
    norm_type: float = 2.0
    """Norm used for ``max_norm`` (``float('inf')``: max norm)."""
    reduce_bucket_size_in_m: float = 12
    """Gradient bucket size in millions (2**20) of elements."""
    communication_dtype: torch.dtype | None = None
    """dtype gradients are reduced in (default: the working dtype)."""
    overlap_communication: bool = True
    """Reduce gradient buckets while backward continues."""
    cpu_offload: bool = False
    """fp32 master weights, gradient partitions and optimizer states on the CPU."""
    master_weights: bool = True
    """Keep fp32 master weights (``False``: the optimizer steps the working weights)."""
    verbose: bool = False
    """Log the partition layout and loss-scale changes on rank 0."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2):
            hint = {
                0: "use TorchDDPPlugin for plain data parallelism",
                3: "use GeminiPlugin or TorchFSDPPlugin for ZeRO stage 3",
            }.get(self.stage if isinstance(self.stage, int) else -1, "pass 1 or 2")
            raise ValueError(f"stage={self.stage!r}: LowLevelZeroPlugin supports 1 and 2; {hint}.")
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} must be one of {sorted(PRECISIONS)} "
                "(LowLevelZeroPlugin controls precision; do not pass Booster(mixed_precision=))."
            )
        clip = self.max_norm
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < 1e308:
            raise ValueError(f"max_norm={clip!r} must be a finite number >= 0 (0: no clipping).")
        check_norm_type(self.norm_type)
        size = self.reduce_bucket_size_in_m
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < 1e308:
            raise ValueError(
                f"reduce_bucket_size_in_m={size!r} must be a positive, finite number of millions "
                "of elements, e.g. 12."
            )
        if self.communication_dtype is not None and self.communication_dtype not in COMM_DTYPES:
            raise ValueError(
                f"communication_dtype={self.communication_dtype!r} must be None, torch.float16, "
                "torch.bfloat16 or torch.float32."
            )
        check_flags(self, ("overlap_communication", "cpu_offload", "master_weights", "verbose"))

    @property
    def dtype(self) -> torch.dtype:
        """The working dtype."""
        return PRECISIONS[self.precision]

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`."""
        return {
            **self.loss_scale.as_kwargs(),
            "clip_grad_norm": float(self.max_norm),
            "norm_type": float(self.norm_type),
            "verbose": self.verbose,
            "reduce_bucket_size": max(1, int(self.reduce_bucket_size_in_m * 2**20)),
            "communication_dtype": self.communication_dtype,
            "overlap_communication": self.overlap_communication,
            "partition_grad": self.stage == 2,
            "cpu_offload": self.cpu_offload,
            "master_weights": self.master_weights,
        }
