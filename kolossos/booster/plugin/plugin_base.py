"""The plugin contract: what every parallelisation recipe tells and does for the Booster."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from kolossos.interface import OptimizerWrapper

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO

Criterion = Callable[..., torch.Tensor]
Boosted = tuple[
    nn.Module,
    OptimizerWrapper | None,
    Criterion | None,
    DataLoader[Any] | None,
    LRScheduler | None,
]


class Plugin(ABC):
    """A parallelisation recipe. The Booster asks it what it supports, then lets it wrap the
    training objects (``configure``), save and load them (``get_checkpoint_io``) and skip
    gradient synchronisation (``no_sync``).

    A plugin validates its arguments when constructed (before any collective), so a bad
    configuration fails at once with a message naming the argument.
    """

    @abstractmethod
    def supported_devices(self) -> list[str]:
        """Device types this plugin runs on (``'cpu'``, ``'cuda'``)."""

    @abstractmethod
    def supported_precisions(self) -> list[str]:
        """Precision names accepted (``'fp32'``, ``'fp16'``, ``'bf16'``, ...)."""

    @abstractmethod
    def control_precision(self) -> bool:
        """Whether the plugin applies mixed precision itself (then ``Booster(mixed_precision=)``
        must not be given; pass ``precision=`` to the plugin)."""

    @abstractmethod
    def control_device(self) -> bool:
        """Whether the plugin places the model on devices itself."""

    @abstractmethod
    def support_no_sync(self) -> bool:
        """Whether :meth:`no_sync` (gradient accumulation without communication) is available."""

    def support_pipeline(self) -> bool:
        """Whether ``booster.execute_pipeline`` works with this plugin."""
        return False

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Wrap the training objects; returns them in the same order."""

    @abstractmethod
    def control_checkpoint_io(self) -> bool:
        """Whether the plugin brings its own checkpoint IO."""

    @abstractmethod
    def get_checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO for models and optimizers boosted by this plugin."""

    @abstractmethod
    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        """A context in which backward passes accumulate gradients locally, without
        communication; the next backward outside it synchronises them."""

    @abstractmethod
    def prepare_dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        **kwargs: Any,
    ) -> DataLoader[Any]:
        """A data loader that gives each data-parallel rank its own part of ``dataset``."""

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Criterion,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Run one pipelined forward/backward over micro-batches (pipeline plugins only)."""
        raise NotImplementedError(f"{type(self).__name__} does not run pipeline schedules.")

    @property
    def name(self) -> str:
        """The plugin's class name."""
        return type(self).__name__
