"""``TorchDDPPlugin``: data parallelism with PyTorch's ``DistributedDataParallel``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.booster.plugin.dp_plugin_base import DPPluginBase
from kolossos.booster.plugin.plugin_base import Boosted, Criterion, config_from_arguments
from kolossos.checkpoint_io import CheckpointIO, GeneralCheckpointIO
from kolossos.ddp import TorchDDPConfig, TorchDDPModel
from kolossos.interface import OptimizerWrapper


class TorchDDPPlugin(DPPluginBase):
    """Data parallelism over every process with PyTorch DDP: each rank holds the whole model,
    gradients are averaged by bucketed all-reduce overlapped with backward.

    Works with every ``Booster(mixed_precision=...)`` recipe, ``booster.no_sync`` for gradient
    accumulation, and clipping by norm and by value. Suits models that fit on one device.

    Args: see :class:`~kolossos.ddp.TorchDDPConfig` (the same names as DDP's).

    Example:
        >>> plugin = TorchDDPPlugin()
        >>> booster = Booster(plugin=plugin)
        >>> model, optimizer, criterion, loader, _ = booster.boost(model, optimizer, criterion,
        ...                                                       dataloader)  # doctest: +SKIP
    """

    config_factory = TorchDDPConfig

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        self.config = config_from_arguments(TorchDDPConfig, locals())
        super().__init__()

    def supported_precisions(self) -> list[str]:
        return ["fp32", "fp16", "fp16_naive", "fp16_apex", "bf16"]

    def control_precision(self) -> bool:
        return False

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        wrapped = TorchDDPModel(model, self.config, self.dp_group)
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        return wrapped, optimizer, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        return GeneralCheckpointIO()

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        if not isinstance(model, TorchDDPModel):
            raise TypeError(
                f"no_sync needs the model returned by booster.boost with {self.name}, got "
                f"{type(model).__name__}."
            )
        return model.ddp.no_sync()

    def __repr__(self) -> str:
        return f"TorchDDPPlugin({self.config}, dp_size={self.dp_size})"
