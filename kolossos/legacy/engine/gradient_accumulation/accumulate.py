"""Gradient accumulation for the legacy Engine: wrappers that let ``accumulate_size``
iterations add up their gradients before one optimizer (and lr scheduler, and handler) step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from kolossos.interface import OptimizerWrapper
from kolossos.interface.protocols import LossScaler
from kolossos.legacy.engine.gradient_handler.base import BaseGradientHandler

__all__ = [
    "GradAccumDataloader",
    "GradAccumGradientHandler",
    "GradAccumLrSchedulerByStep",
    "GradAccumOptimizer",
    "accumulate_gradient",
]


def _check_size(accumulate_size: int) -> None:
    if isinstance(accumulate_size, bool) or not isinstance(accumulate_size, int):
        raise TypeError(f"accumulate_size={accumulate_size!r} must be an int >= 1.")
    if accumulate_size < 1:
        raise ValueError(f"accumulate_size={accumulate_size} must be >= 1.")


class GradAccumOptimizer(OptimizerWrapper):
    """Divides each loss by ``accumulate_size`` and steps (clips, zeroes) only once every
    ``accumulate_size`` backward passes. Under torch DDP the intermediate backward passes run in
    ``model.no_sync()``, so gradients are all-reduced once per step.

    Args:
        optim: the optimizer (a kolossos ``OptimizerWrapper``, e.g. an AMP one, or a torch one).
        accumulate_size: backward passes per step.
        model: the model (its ``no_sync`` is used when it is a ``DistributedDataParallel``).
    """

    def __init__(
        self,
        optim: Optimizer | OptimizerWrapper,
        accumulate_size: int,
        model: nn.Module | None = None,
    ) -> None:
        _check_size(accumulate_size)
        self.inner = optim if isinstance(optim, OptimizerWrapper) else OptimizerWrapper(optim)
        super().__init__(self.inner.unwrap())
        self.accumulate_size = accumulate_size
        self.accumulate_step = 0
        self.model = model
        self.is_torch_ddp = isinstance(model, DDP)

    @property
    def at_boundary(self) -> bool:
        """Whether the current backward pass completes an accumulation cycle."""
        return self.accumulate_step >= self.accumulate_size

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The wrapped optimizer's parameters."""
        return self.inner.parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients only at the start of a cycle."""
        if self.accumulate_step == 0:
            self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Step at the end of a cycle (and start a new one); ``None`` otherwise."""
        if not self.at_boundary:
            return None
        self.accumulate_step = 0
        return self.inner.step(*args, **kwargs)

    def clip_grad_by_norm(  # type: ignore[override]
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor | None:
        """Clip at the end of a cycle; ``None`` (nothing clipped) otherwise."""
        if not self.at_boundary:
            return None
        return self.inner.clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Clip by value at the end of a cycle."""
        if self.at_boundary:
            self.inner.clip_grad_by_value(clip_value, *args, **kwargs)

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        if self.is_torch_ddp and not self.at_boundary:
            assert isinstance(self.model, DDP)
            return self.model.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss / accumulate_size`` (without DDP's all-reduce mid-cycle)."""
        self.accumulate_step += 1
        with self._no_sync():
            self.inner.backward(loss / self.accumulate_size, *args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with ``grad`` (without DDP's all-reduce mid-cycle)."""
        self.accumulate_step += 1
        with self._no_sync():
            self.inner.backward_by_grad(tensor, grad)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state dict."""
        self.inner.load_state_dict(state_dict)

    def working_params(self) -> list[torch.Tensor]:
        """The wrapped optimizer's working parameters."""
        return self.inner.working_params()

    def sync_master_weights(self) -> None:
        """Refresh the wrapped optimizer's master copies."""
        self.inner.sync_master_weights()

    def get_loss_scaler(self) -> LossScaler | None:
        """The wrapped optimizer's loss scaler, if any."""
        return self.inner.get_loss_scaler()


class GradAccumDataloader:
    """Yields the first ``len(dataloader) - len(dataloader) % accumulate_size`` batches of each
    epoch, so every epoch ends on a full cycle. An iterable that is not a
    ``torch.utils.data.DataLoader`` is drained after the last used batch (as upstream does for
    DALI-style loaders). Other attributes are the wrapped dataloader's.

    Args:
        dataloader: an iterable with ``len``.
        accumulate_size: batches per optimizer step.
    """

    def __init__(self, dataloader: Iterable[Any], accumulate_size: int) -> None:
        _check_size(accumulate_size)
        self.dataloader = dataloader
        self.consume_remain_data = not isinstance(dataloader, torch.utils.data.DataLoader)
        length = len(dataloader)  # type: ignore[arg-type]
        self.steps_per_epoch = length - length % accumulate_size

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.dataloader)
        for step in range(self.steps_per_epoch):
            yield next(it)
            if step == self.steps_per_epoch - 1 and self.consume_remain_data:
                for _ in it:
                    pass


class GradAccumLrSchedulerByStep:
    """Steps the wrapped lr scheduler once every ``accumulate_size`` calls of :meth:`step`;
    other attributes (``get_last_lr``, ``state_dict``...) are the wrapped scheduler's.

    Args:
        lr_scheduler: a torch (or kolossos) lr scheduler.
        accumulate_size: calls per real step.
    """

    def __init__(self, lr_scheduler: Any, accumulate_size: int) -> None:
        _check_size(accumulate_size)
        self.lr_scheduler = lr_scheduler
        self.accumulate_size = accumulate_size
        self.accumulate_step = 0

    @staticmethod
    def compute_effective_steps_per_epoch(dataloader: Iterable[Any], accumulate_size: int) -> int:
        """Optimizer steps per epoch of ``dataloader``."""
        return len(dataloader) // accumulate_size  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "lr_scheduler":
            raise AttributeError(name)
        return getattr(self.lr_scheduler, name)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Count a call; step the wrapped scheduler at the end of a cycle."""
        self.accumulate_step += 1
        if self.accumulate_step >= self.accumulate_size:
            self.accumulate_step = 0
            self.lr_scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state dict."""
        state: dict[str, Any] = self.lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state dict."""
        self.lr_scheduler.load_state_dict(state_dict)


class GradAccumGradientHandler:
    """Runs the wrapped gradient handler once every ``accumulate_size`` calls.

    Raises:
        TypeError: ``grad_handler`` is not a :class:`BaseGradientHandler`.
    """

    def __init__(self, grad_handler: BaseGradientHandler, accumulate_size: int) -> None:
        if not isinstance(grad_handler, BaseGradientHandler):
            raise TypeError(
                f"grad_handler must be a BaseGradientHandler, got {type(grad_handler).__name__}."
            )
        _check_size(accumulate_size)
        self.grad_handler = grad_handler
        self.accumulate_size = accumulate_size
        self.accumulate_step = 0

    def handle_gradient(self) -> None:
        """Count a call; reduce the gradients at the end of a cycle."""
        self.accumulate_step += 1
        if self.accumulate_step >= self.accumulate_size:
            self.accumulate_step = 0
            self.grad_handler.handle_gradient()


def accumulate_gradient(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper,
    dataloader: Iterable[Any] | None,
    accumulate_size: int,
    gradient_handlers: list[BaseGradientHandler] | None = None,
    lr_scheduler: Any = None,
) -> tuple[
    GradAccumOptimizer,
    GradAccumDataloader | None,
    list[GradAccumGradientHandler] | None,
    GradAccumLrSchedulerByStep | None,
]:
    """Wrap optimizer, dataloader, handlers and lr scheduler for ``accumulate_size`` iterations
    per step (``None`` stays ``None``).

    Example:
        >>> optimizer, loader, handlers, sched = accumulate_gradient(
        ...     model, optimizer, loader, 4, lr_scheduler=sched)  # doctest: +SKIP
    """
    optim = GradAccumOptimizer(optimizer, accumulate_size, model=model)
    loader = None if dataloader is None else GradAccumDataloader(dataloader, accumulate_size)
    handlers = None
    if gradient_handlers is not None:
        handlers = [GradAccumGradientHandler(h, accumulate_size) for h in gradient_handlers]
    sched = None
    if lr_scheduler is not None:
        sched = GradAccumLrSchedulerByStep(lr_scheduler, accumulate_size)
    return optim, loader, handlers, sched
