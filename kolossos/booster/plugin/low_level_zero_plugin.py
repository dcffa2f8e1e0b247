"""``LowLevelZeroPlugin``: ZeRO stage 1 and 2 data parallelism.

The recipe (the pieces live in :mod:`kolossos.zero.low_level`): validate the arguments into a
:class:`~kolossos.zero.low_level.config.LowLevelZeroConfig`; at ``boost`` move the model to the
device in the working dtype (:class:`~kolossos.zero.low_level.LowLevelZeroModel`), then wrap
the optimizer into a :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`, which flattens
and partitions the parameters; checkpoints go through
:class:`~kolossos.zero.low_level.checkpoint_io.LowLevelZeroCheckpointIO`.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.booster.plugin.dp_plugin_base import DPPluginBase
from kolossos.booster.plugin.plugin_base import Boosted, Criterion, config_from_arguments
from kolossos.interface import OptimizerWrapper, ParamOwners
from kolossos.zero.low_level import LowLevelZeroModel, LowLevelZeroOptimizer
from kolossos.zero.low_level.checkpoint_io import LowLevelZeroCheckpointIO
from kolossos.zero.low_level.config import LowLevelZeroConfig

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO

__all__ = ["LowLevelZeroPlugin"]


class LowLevelZeroPlugin(DPPluginBase):
    """ZeRO stage 1 (optimizer states sharded) or 2 (gradients too) over all processes.

    Each rank keeps the whole model in the working precision and steps 1/N of it with fp32
    master weights; gradients are reduced in buckets to their owners during backward, updated
    weights are gathered after the step. ``booster.no_sync`` works for both stages (stage 2 still
    communicates at every backward, see ``docs/zero.md``). Precision is the plugin's business:
    do not pass ``Booster(mixed_precision=...)``.

    Args: see :class:`~kolossos.zero.low_level.config.LowLevelZeroConfig` (Colossal-AI's names
        and defaults; the seven loss-scale keywords form its ``loss_scale`` policy).

    Example:
        >>> plugin = LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0)  # doctest: +SKIP
        >>> booster = Booster(plugin=plugin)  # doctest: +SKIP
        >>> model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    """

    config_factory = LowLevelZeroConfig

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
        master_weights: bool = True,
        verbose: bool = False,
    ) -> None:
        self.config = config_from_arguments(LowLevelZeroConfig, locals())
        super().__init__()
        self.owners = ParamOwners()
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
        wrapped = LowLevelZeroModel(model, self.config.dtype, self.dp_group)
        zero: LowLevelZeroOptimizer | None = None
        if optimizer is not None:
            inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
            zero = LowLevelZeroOptimizer(
                inner, dp_process_group=self.dp_group, **self.config.optimizer_kwargs()
            )
            zero.set_param_names(wrapped.unwrap())
            self.owners.register(zero, zero.parameters())
            self._optimizers[wrapped] = zero
        return wrapped, zero, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        return LowLevelZeroCheckpointIO(self.dp_group, self.owners)

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
