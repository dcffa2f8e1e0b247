"""Validated options of :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["COMM_DTYPES", "ZeroOptions"]

#: dtypes gradients may be communicated in
COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")


def check_norm_type(norm_type: object) -> float:
    """``norm_type`` as a float: a number > 0, or ``inf``; raises ``ValueError`` otherwise."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type={norm_type!r} must be a number (2.0, 1.0, float('inf')).")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type={norm_type!r} must be > 0 (e.g. 2.0) or float('inf').")
    return float(norm_type)


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """How the ZeRO optimizer partitions, communicates and clips (the loss-scaler arguments are
    checked by :class:`kolossos.amp.DynamicGradScaler`)."""

    partition_grad: bool = False
    """False: ZeRO stage 1 (optimizer states sharded); True: stage 2 (gradients sharded too)."""
    reduce_bucket_size: int = 1024 * 1024
    """Largest gradient bucket in elements; buckets also end at partition boundaries."""
    communication_dtype: torch.dtype | None = None
    """dtype gradients are reduced in; ``None``: the parameters' (working) dtype."""
    overlap_communication: bool = False
    """Reduce buckets asynchronously while backward goes on."""
    cpu_offload: bool = False
    """Keep fp32 master weights, the gradient partition and optimizer states on the CPU."""
    clip_grad_norm: float = 0.0
    """Clip gradients to this global norm at every step; 0 disables it."""
    norm_type: float = 2.0
    """The norm used by ``clip_grad_norm`` (``inf`` for the max norm)."""
    forced_dtype: torch.dtype | None = None
    """Cast the managed parameters to this dtype first (``None``: keep theirs)."""
    verbose: bool = False
    """Log the partition and bucket layout, and loss-scale changes, on rank 0."""
    master_weights: bool = True
    """Keep fp32 master partitions; ``False``: the optimizer steps the working-dtype weights
    (and keeps its states) directly, as Colossal-AI's ``master_weights=False``."""

    def __post_init__(self) -> None:
        names = ("partition_grad", "overlap_communication", "cpu_offload", "verbose",
                 "master_weights")  # fmt: skip
        for name in names:
            _check_bool(name, getattr(self, name))
        size = self.reduce_bucket_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"reduce_bucket_size={size!r} must be a positive number of elements, "
                "e.g. 12 * 1024 * 1024."
            )
        dtype = self.communication_dtype
        if dtype is not None and dtype not in COMM_DTYPES:
            raise ValueError(
                f"communication_dtype={dtype!r} must be None, torch.float16, torch.bfloat16 or "
                "torch.float32."
            )
        if self.forced_dtype is not None and self.forced_dtype not in COMM_DTYPES:
            raise ValueError(
                f"forced_dtype={self.forced_dtype!r} must be None, torch.float16, "
                "torch.bfloat16 or torch.float32."
            )
        clip = self.clip_grad_norm
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
            raise ValueError(f"clip_grad_norm={clip!r} must be a number >= 0 (0 disables it).")
        if math.isinf(clip):
            raise ValueError("clip_grad_norm=inf clips nothing; pass 0.0 to disable clipping.")
        object.__setattr__(self, "norm_type", check_norm_type(self.norm_type))
