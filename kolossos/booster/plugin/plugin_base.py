"""The plugin contract: what every parallelisation recipe tells and does for the Booster."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from kolossos.amp import LOSS_SCALE_KEYWORDS, LossScalePolicy
from kolossos.interface import OptimizerWrapper

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO

C = TypeVar("C")

Criterion = Callable[..., torch.Tensor]
Boosted = tuple[
    nn.Module,
    OptimizerWrapper | None,
    Criterion | None,
    DataLoader[Any] | None,
    LRScheduler | None,
]


def config_from_arguments(factory: Callable[..., C], arguments: Mapping[str, Any]) -> C:
    """The engine config built from a plugin constructor's arguments — the one way every plugin
    turns Colossal-AI's keywords into its engine's config object.

    ``arguments`` is the constructor's ``locals()``: ``self`` is dropped, a ``**kwargs`` catch-all
    (named ``kwargs``) is merged in, and the seven loss-scale keywords (``initial_scale`` ...
    ``max_scale``) are grouped into one :class:`~kolossos.amp.LossScalePolicy` passed as
    ``loss_scale``. ``factory`` is the engine's config class (or its documented mapping function,
    e.g. FSDP1 keywords onto FSDP2).

    Example:
        >>> def __init__(self, stage=1, initial_scale=2**32, hysteresis=2):  # doctest: +SKIP
        ...     self.config = config_from_arguments(LowLevelZeroConfig, locals())
    """
    given = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
    given.update(given.pop("kwargs", None) or {})
    if any(name in given for name in LOSS_SCALE_KEYWORDS):
        given["loss_scale"] = LossScalePolicy.take(given)
    return factory(**given)


class Plugin(ABC):
    """A parallelisation recipe. The Booster asks it what it supports, then lets it wrap the
    training objects (``configure``), save and load them (``get_checkpoint_io``) and skip
    gradient synchronisation (``no_sync``).

    A plugin validates its arguments when constructed (before any collective), so a bad
    configuration fails at once with a message naming the argument.

    Every plugin also tells how the processes divide the data (what data loaders, the trainer
    and metrics need): ``dp_size`` replicas of the model, this process being replica ``dp_rank``
    (ranks that hold different shards of one replica share a ``dp_rank``).
    """

    dp_size: int
    """The number of data-parallel replicas (the processes that see different data)."""
    dp_rank: int
    """This process's data-parallel rank, in ``[0, dp_size)``."""
    config_factory: ClassVar[Callable[..., Any] | None] = None
    """The engine config class (or mapping function) the constructor builds with
    :func:`config_from_arguments`; ``None`` for a plugin without one, whose
    :meth:`check_arguments` then checks the keyword names only."""
    plugin_arguments: ClassVar[tuple[str, ...]] = ()
    """Constructor keywords the plugin keeps for itself (not fields of the engine config)."""

    @classmethod
    def check_arguments(cls, **kwargs: Any) -> Any:
        """Validate constructor keywords without a process group, as the constructor would.

        The constructor's defaults are applied to ``kwargs`` and the result goes through
        :func:`config_from_arguments` with :attr:`config_factory`: the same checks, and the same
        messages, as ``cls(**kwargs)`` before its first collective. Checks that need the process
        group or the device (world-size divisibility, the current device) are left to the
        constructor. ``kolossos train`` calls this before it starts any process.

        Returns:
            The engine config the constructor would build, or ``None`` without
            :attr:`config_factory`.

        Raises:
            TypeError: an unknown or missing keyword, or a value of the wrong type (named).
            ValueError: a value out of range (named).
            NotImplementedError: an option this implementation does not provide (named).

        Example:
            >>> TorchDDPPlugin.check_arguments(bucket_cap_mb=10).bucket_cap_mb  # doctest: +SKIP
            10
        """
        bound = inspect.signature(cls.__init__).bind(None, **kwargs)  # None stands for self
        bound.apply_defaults()
        if cls.config_factory is None:
            return None
        arguments = {k: v for k, v in bound.arguments.items() if k not in cls.plugin_arguments}
        return config_from_arguments(cls.config_factory, arguments)

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
