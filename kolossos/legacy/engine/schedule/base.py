"""``BaseSchedule``: how one training (or evaluation) step runs through the Engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from kolossos.accelerator import get_accelerator
from kolossos.logging import get_dist_logger

if TYPE_CHECKING:
    from kolossos.legacy.engine.engine import Engine

__all__ = ["BaseSchedule", "StepResult"]

#: ``(output, label, loss)``; each may be ``None`` (see ``return_loss``/``return_output_label``)
StepResult = tuple[Any, Any, Any]


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


class BaseSchedule(ABC):
    """A step schedule: subclass it and implement :meth:`forward_backward_step`, then pass an
    instance to ``Engine(schedule=...)``.

    Args:
        data_process_func: turns one batch from the data iterator into ``(data, label)``
            (default: the batch is that pair already).

    Example:
        >>> class MySchedule(BaseSchedule):
        ...     def forward_backward_step(self, engine, data_iter, forward_only=False,
        ...                               return_loss=True, return_output_label=True):
        ...         data, label = self.load_batch(data_iter)
        ...         output = self._call_engine(engine, data)
        ...         loss = self._call_engine_criterion(engine, output, label)
        ...         if not forward_only:
        ...             engine.backward(loss)
        ...         return output, label, loss
    """

    def __init__(self, data_process_func: Callable[[Any], tuple[Any, Any]] | None = None) -> None:
        self.logger = get_dist_logger()
        self.data_process_func = data_process_func
        self.batch_size: int | None = None

    def load_batch(self, data_iter: Iterator[Any] | None, to_gpu: bool = True) -> Any:
        """The next batch of ``data_iter``, moved to the accelerator's device when ``to_gpu``.

        Raises:
            RuntimeError: ``data_iter`` is ``None`` (no dataloader was given).
            TypeError: the batch is not a tensor, list, tuple or dict.
        """
        if data_iter is None:
            raise RuntimeError(
                "no data iterator: pass iter(train_dataloader) to engine.execute_schedule."
            )
        batch = next(data_iter)
        if not isinstance(batch, (torch.Tensor, list, tuple, dict)):
            raise TypeError(
                f"a batch must be a tensor, list, tuple or dict, got {type(batch).__name__}; "
                "give the schedule a data_process_func that returns (data, label)."
            )
        if to_gpu:
            batch = _to_device(batch, get_accelerator().get_current_device())
        self.batch_size = _batch_size(batch)
        return batch

    def pre_processing(self, engine: Engine) -> None:  # noqa: B027 - an optional hook
        """Called once by the Engine that takes this schedule."""

    @abstractmethod
    def forward_backward_step(
        self,
        engine: Engine,
        data_iter: Iterator[Any] | None,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """Run forward (and backward unless ``forward_only``) over one batch of ``data_iter``.

        Returns:
            ``(output, label, loss)``; output and label are ``None`` unless
            ``return_output_label``, loss is ``None`` unless ``return_loss``.
        """

    @staticmethod
    def _call_engine(engine: Engine, inputs: Any) -> Any:
        """``engine(inputs)``: a tensor positionally, a list/tuple unpacked, a dict as keywords."""
        if isinstance(inputs, torch.Tensor):
            return engine(inputs)
        if isinstance(inputs, (list, tuple)):
            return engine(*inputs)
        if isinstance(inputs, dict):
            return engine(**inputs)
        raise TypeError(
            f"model inputs must be a tensor, list, tuple or dict, got {type(inputs).__name__}."
        )

    @staticmethod
    def _call_engine_criterion(engine: Engine, outputs: Any, labels: Any) -> torch.Tensor:
        """``engine.criterion(*outputs, *labels)`` (dict labels as keywords)."""
        if engine.criterion is None:
            raise RuntimeError("the Engine has no criterion: pass criterion= to initialize.")
        outs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        labs = (labels,) if isinstance(labels, torch.Tensor) else labels
        if isinstance(outs, (list, tuple)) and isinstance(labs, (list, tuple)):
            return engine.criterion(*outs, *labs)
        if isinstance(outs, (list, tuple)) and isinstance(labs, dict):
            return engine.criterion(*outs, **labs)
        if isinstance(outs, dict) and isinstance(labs, dict):
            return engine.criterion(**outs, **labs)
        raise TypeError(
            f"model outputs ({type(outputs).__name__}) and labels ({type(labels).__name__}) must "
            "be tensors, lists/tuples or dicts, and dict outputs need dict labels."
        )


def _batch_size(batch: Any) -> int | None:
    first = batch
    while isinstance(first, (list, tuple, dict)) and len(first) > 0:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(first.size(0)) if isinstance(first, torch.Tensor) and first.dim() > 0 else None
