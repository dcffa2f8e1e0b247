"""``Engine``: the legacy training object ``initialize`` returns (model, optimizer, criterion,
gradient handlers, clipping and a step schedule behind PyTorch-like calls)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn

from kolossos.interface import OptimizerWrapper
from kolossos.legacy.engine.schedule import BaseSchedule, NonPipelineSchedule, PipelineSchedule
from kolossos.legacy.engine.schedule.base import StepResult

__all__ = ["Engine", "GradientHandler"]


class GradientHandler(Protocol):
    """What the Engine calls before a step (a ``BaseGradientHandler`` or a wrapper of one)."""

    def handle_gradient(self) -> None:
        """Reduce the gradients."""


def _no_ophooks(ophooks: Sequence[Any] | None) -> None:
    if ophooks:
        raise NotImplementedError(
            f"ophooks ({len(ophooks)} given) are not supported by kolossos' Engine; use torch "
            "module hooks (register_forward_hook / register_full_backward_hook) on the model."
        )


class Engine:
    """Training and evaluation through one object, as Colossal-AI's legacy API has it:

    =========================  ============================
    ``engine.zero_grad()``     ``optimizer.zero_grad()``
    ``output = engine(x)``     ``model(x)``
    ``engine.criterion(o, y)`` ``criterion(o, y)``
    ``engine.backward(loss)``  ``loss.backward()`` (scaled under AMP)
    ``engine.step()``          gradient handlers, clipping, ``optimizer.step()``
    ``engine.train()/eval()``  ``model.train()/eval()``
    =========================  ============================

    Usually built by :func:`kolossos.legacy.initialize` from the launch config.

    Args:
        model: the (wrapped) model.
        optimizer: a kolossos ``OptimizerWrapper`` (a torch optimizer is wrapped).
        criterion: the loss function, or ``None``.
        gradient_handlers: run in order by :meth:`step` before clipping.
        clip_grad_norm: clip the global gradient norm to this value in :meth:`step` (0: off).
        ophook_list: not supported (must be empty).
        verbose: kept for Colossal-AI's signature (the Engine logs nothing per step).
        schedule: the step schedule of :meth:`execute_schedule` (default
            :class:`NonPipelineSchedule`).

    Raises:
        ValueError: a negative ``clip_grad_norm``.
        NotImplementedError: ``ophook_list`` is not empty.

    Example:
        >>> engine, train_loader, _, _ = kolossos.initialize(model, optimizer, criterion,
        ...                                                  train_loader)  # doctest: +SKIP
        >>> engine.train()
        >>> for x, y in train_loader:
        ...     engine.zero_grad()
        ...     loss = engine.criterion(engine(x), y)
        ...     engine.backward(loss)
        ...     engine.step()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerWrapper | torch.optim.Optimizer,
        criterion: Callable[..., torch.Tensor] | None = None,
        gradient_handlers: Sequence[GradientHandler] | None = None,
        clip_grad_norm: float = 0.0,
        ophook_list: Sequence[Any] | None = None,
        verbose: bool = True,
        schedule: BaseSchedule | None = None,
    ) -> None:
        _no_ophooks(ophook_list)
        if clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm={clip_grad_norm} must be >= 0 (0 switches it off).")
        if not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        self._model = model
        self._optimizer = optimizer
        self._criterion = criterion
        self._gradient_handlers = list(gradient_handlers or [])
        self._clip_grad_norm = float(clip_grad_norm)
        self._verbose = verbose
        self._schedule = schedule if schedule is not None else NonPipelineSchedule()
        self.training = model.training
        self._schedule.pre_processing(self)

    @property
    def model(self) -> nn.Module:
        """The model."""
        return self._model

    @property
    def optimizer(self) -> OptimizerWrapper:
        """The optimizer."""
        return self._optimizer

    @property
    def criterion(self) -> Callable[..., torch.Tensor] | None:
        """The loss function."""
        return self._criterion

    @property
    def schedule(self) -> BaseSchedule:
        """The step schedule."""
        return self._schedule

    @property
    def gradient_handlers(self) -> list[GradientHandler]:
        """The gradient handlers :meth:`step` runs."""
        return self._gradient_handlers

    @property
    def ophooks(self) -> list[Any]:
        """Always empty (op hooks are not supported)."""
        return []

    @property
    def uses_pipeline(self) -> bool:
        """Whether the schedule is a pipeline schedule (``PipelineSchedule`` or
        ``InterleavedPipelineSchedule``)."""
        return isinstance(self._schedule, PipelineSchedule)

    def add_hook(self, ophook: Any) -> None:
        """Not supported: raises ``NotImplementedError``."""
        _no_ophooks([ophook])

    def remove_hook(self, ophook: Any) -> None:
        """Not supported: raises ``NotImplementedError``."""
        _no_ophooks([ophook])

    def zero_grad(self) -> None:
        """Reset the gradients (under gradient accumulation: at the start of a cycle only)."""
        self._optimizer.zero_grad()

    def step(self) -> Any:
        """Run the gradient handlers, clip to ``clip_grad_norm`` (if set), step the optimizer.

        Returns:
            The optimizer's ``step`` result (``None`` for a skipped or accumulating step).
        """
        for handler in self._gradient_handlers:
            handler.handle_gradient()  # SYNC POINT (a handler's collective)
        if self._clip_grad_norm > 0:
            self._optimizer.clip_grad_by_norm(self._clip_grad_norm)
        return self._optimizer.step()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` through the optimizer (which scales it under AMP)."""
        self._optimizer.backward(loss)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with the upstream gradient ``grad``."""
        self._optimizer.backward_by_grad(tensor, grad)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""
        return self._model(*args, **kwargs)

    def execute_schedule(
        self,
        data_iter: Iterator[Any] | None,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """One forward (and backward unless ``forward_only``) over the next batch of
        ``data_iter``, run by the schedule; the optimizer step stays with :meth:`step`.

        Returns:
            ``(output, label, loss)`` (see :meth:`BaseSchedule.forward_backward_step`).
        """
        return self._schedule.forward_backward_step(
            self,
            data_iter,
            forward_only=forward_only,
            return_loss=return_loss,
            return_output_label=return_output_label,
        )

    def train(self) -> None:
        """Put the model in training mode."""
        self.training = True
        self._model.train()

    def eval(self) -> None:
        """Put the model in evaluation mode."""
        self.training = False
        self._model.eval()
