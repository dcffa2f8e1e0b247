"""``LowLevelZeroPlugin``: ZeRO stage 1 and 2 data parallelism.

The recipe (the pieces live in :mod:`kolossos.zero.low_level`): validate the arguments into a
:class:`LowLevelZeroConfig`; at ``boost`` move the model to the device in the working dtype
(:class:`~kolossos.zero.low_level.LowLevelZeroModel`), then wrap the optimizer into a
:class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`, which flattens and partitions the
parameters; checkpoints go through
:class:`~kolossos.zero.low_level.checkpoint_io.LowLevelZeroCheckpointIO`.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.amp import DynamicGradScaler
from kolossos.booster.plugin.dp_plugin_base import DPPluginBase
from kolossos.booster.plugin.plugin_base import Boosted, Criterion
from kolossos.interface import OptimizerWrapper
from kolossos.zero.low_level import LowLevelZeroModel, LowLevelZeroOptimizer
from kolossos.zero.low_level.options import COMM_DTYPES, check_norm_type

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO

__all__ = ["LowLevelZeroConfig", "LowLevelZeroPlugin"]

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class LowLevelZeroConfig:
    """The arguments of :class:`LowLevelZeroPlugin`, validated."""

    stage: int = 1
    """1: shard optimizer states; 2: also shard gradients."""
    precision: str = "fp16"
    """Working dtype of the model: ``'fp16'`` (with a dynamic loss scale), ``'bf16'``, ``'fp32'``;
    fp16/bf16 keep fp32 master weights in the optimizer."""
    initial_scale: float = 2**32
    """fp16 loss scale to start with."""
    min_scale: float = 1
    """Floor of the fp16 loss scale."""
    growth_factor: float = 2
    """Factor the loss scale grows by after ``growth_interval`` good steps."""
    backoff_factor: float = 0.5
    """Factor the loss scale shrinks by on overflow."""
    growth_interval: int = 1000
    """Good steps between two growths of the loss scale."""
    hysteresis: int = 2
    """Overflows tolerated (since the last growth) before the loss scale backs off."""
    max_scale: float = 2**32
    """Cap of the fp16 loss scale."""
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
    verbose: bool = False
    """Log the partition layout and loss-scale changes on rank 0."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2):
            hint = {
                0: "use TorchDDPPlugin for plain data parallelism",
                3: "use GeminiPlugin or TorchFSDPPlugin for ZeRO stage 3",
            }.get(self.stage if isinstance(self.stage, int) else -1, "pass 1 or 2")
            raise ValueError(f"stage={self.stage!r}: LowLevelZeroPlugin supports 1 and 2; {hint}.")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} must be one of {sorted(PRECISIONS)} "
                "(LowLevelZeroPlugin controls precision; do not pass Booster(mixed_precision=))."
            )
        DynamicGradScaler(  # validates the scaler's arguments with its own messages
            initial_scale=self.initial_scale,
            min_scale=self.min_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            max_scale=self.max_scale,
        )
        clip = self.max_norm
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < 1e308:
            raise ValueError(f"max_norm={clip!r} must be a finite number >= 0 (0: no clipping).")
        check_norm_type(self.norm_type)
        size = self.reduce_bucket_size_in_m
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(
                f"reduce_bucket_size_in_m={size!r} must be a positive number of millions of "
                "elements, e.g. 12."
            )
        if self.communication_dtype is not None and self.communication_dtype not in COMM_DTYPES:
            raise ValueError(
                f"communication_dtype={self.communication_dtype!r} must be None, torch.float16, "
                "torch.bfloat16 or torch.float32."
            )
        for name in ("overlap_communication", "cpu_offload", "verbose"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")

    @property
    def dtype(self) -> torch.dtype:
        """The working dtype."""
        return PRECISIONS[self.precision]

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`LowLevelZeroOptimizer` for this configuration."""
        return {
            "initial_scale": self.initial_scale,
            "min_scale": self.min_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "max_scale": self.max_scale,
            "clip_grad_norm": float(self.max_norm),
            "norm_type": float(self.norm_type),
            "verbose": self.verbose,
            "reduce_bucket_size": max(1, int(self.reduce_bucket_size_in_m * 2**20)),
            "communication_dtype": self.communication_dtype,
            "overlap_communication": self.overlap_communication,
            "partition_grad": self.stage == 2,
            "cpu_offload": self.cpu_offload,
        }


class LowLevelZeroPlugin(DPPluginBase):
    """ZeRO stage 1 (optimizer states sharded) or 2 (gradients too) over all processes.

    Each rank keeps the whole model in the working precision and steps 1/N of it with fp32
    master weights; gradients are reduced in buckets to their owners during backward, updated
    weights are gathered after the step. ``booster.no_sync`` works for both stages (stage 2 still
    communicates at every backward, see ``docs/zero.md``). Precision is the plugin's business:
    do not pass ``Booster(mixed_precision=...)``.

    Args: see :class:`LowLevelZeroConfig` (Colossal-AI's names and defaults).

    Example:
        >>> plugin = LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0)  # doctest: +SKIP
        >>> booster = Booster(plugin=plugin)  # doctest: +SKIP
        >>> model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    """

    def __init__(
        self,
        stage: int = 1,
        precision: str = "fp16",
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: float = 12,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        cpu_offload: bool = False,
        verbose: bool = False,
    ) -> None:
        self.config = LowLevelZeroConfig(
            stage=stage,
            precision=precision,
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
            max_norm=max_norm,
            norm_type=norm_type,
            reduce_bucket_size_in_m=reduce_bucket_size_in_m,
            communication_dtype=communication_dtype,
            overlap_communication=overlap_communication,
            cpu_offload=cpu_offload,
            verbose=verbose,
        )
        super().__init__()
        self._optimizers: weakref.WeakKeyDictionary[nn.Module, LowLevelZeroOptimizer] = (
            weakref.WeakKeyDictionary()
        )

    def supported_precisions(self) -> list[str]:
        return ["fp16", "bf16", "fp32"]

    def control_precision(self) -> bool:
        return True

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        wrapped = LowLevelZeroModel(model, self.config.dtype)
        zero: LowLevelZeroOptimizer | None = None
        if optimizer is not None:
            inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
            zero = LowLevelZeroOptimizer(
                inner, dp_process_group=self.dp_group, **self.config.optimizer_kwargs()
            )
            zero.set_param_names(wrapped.unwrap())
            self._optimizers[wrapped] = zero
        return wrapped, zero, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        from kolossos.zero.low_level.checkpoint_io import LowLevelZeroCheckpointIO

        return LowLevelZeroCheckpointIO(self.dp_group)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        zero = optimizer if optimizer is not None else self._optimizers.get(model)
        if not isinstance(zero, LowLevelZeroOptimizer):
            raise TypeError(
                "no_sync needs the model (and optimizer) returned by booster.boost with "
                f"{self.name}; got model {type(model).__name__} and optimizer "
                f"{type(optimizer).__name__}."
            )
        return zero.no_sync()

    def __repr__(self) -> str:
        return f"LowLevelZeroPlugin({self.config}, dp_size={self.dp_size})"
