"""``NonPipelineSchedule``: one forward, loss and backward over a whole batch."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from kolossos.legacy.engine.schedule.base import BaseSchedule, StepResult

if TYPE_CHECKING:
    from kolossos.legacy.engine.engine import Engine

__all__ = ["NonPipelineSchedule"]


class NonPipelineSchedule(BaseSchedule):
    """The schedule without pipeline parallelism: load a batch, ``engine(data)``,
    ``engine.criterion(output, label)``, and ``engine.backward(loss)`` when training.

    Args:
        data_process_func: a one-argument function from a batch to ``(data, label)``.

    Raises:
        ValueError: ``data_process_func`` does not take exactly one parameter.

    Example:
        >>> schedule = NonPipelineSchedule(lambda batch: (batch["x"], batch["y"]))
    """

    def __init__(self, data_process_func: Callable[[Any], tuple[Any, Any]] | None = None) -> None:
        if data_process_func is not None:
            count = len(inspect.signature(data_process_func).parameters)
            if count != 1:
                raise ValueError(
                    f"data_process_func takes {count} parameters; NonPipelineSchedule calls it "
                    "with one, the batch: data_process_func(batch) -> (data, label)."
                )
        super().__init__(data_process_func)

    def forward_backward_step(
        self,
        engine: Engine,
        data_iter: Iterator[Any] | None,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """Forward one batch, compute the loss, and back-propagate unless ``forward_only``.

        Raises:
            ValueError: ``return_loss=False`` while training (the backward needs the loss).
        """
        if not forward_only and not return_loss:
            raise ValueError("return_loss=False needs forward_only=True: backward needs the loss.")
        batch = self.load_batch(data_iter)
        data, label = self.data_process_func(batch) if self.data_process_func else batch
        loss = None
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad:
            output = self._call_engine(engine, data)
            if return_loss:
                loss = self._call_engine_criterion(engine, output, label)
        if not forward_only:
            assert loss is not None  # return_loss is True when training (checked above)
            engine.backward(loss)
        if return_output_label:
            return output, label, loss
        return None, None, loss
