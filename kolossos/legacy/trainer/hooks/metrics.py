"""Metric collectors the metric hooks keep in ``trainer.states["metrics"]``: loss, learning rate,
accuracy and throughput.

Each collector accumulates on this rank; reading a value sums (or averages) over the global
context's DATA group, so under data parallelism every reader sees the value of the global batch.
Those reads are COLLECTIVE over the DATA group: every rank must read, in the same order (the
logging hooks do, and log on one rank only). Reading never changes the state, so a value may be
read any number of times.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from kolossos.legacy.trainer.hooks._common import (
    data_parallel_size,
    format_number,
    metric_tensor,
    reduce_over_data,
)

__all__ = ["AccuracyMetric", "LearningRateMetric", "LossMetric", "Metric", "ThroughputMetric"]


class Metric(ABC):
    """A metric collector, updated by its hook and read by the logging hooks.

    Args:
        epoch_only: whether the value is only meaningful for a whole epoch (the per-step
            loggers skip it).

    Example:
        >>> class CountMetric(Metric):
        ...     def __init__(self):
        ...         super().__init__(epoch_only=True)
        ...         self.n = 0
        ...     def reset(self): self.n = 0
        ...     def update(self): self.n += 1
        ...     def get_last_step_value(self): return 1
        ...     def get_accumulated_value(self): return self.n
        ...     @staticmethod
        ...     def is_better(a, b): return a > b
    """

    def __init__(self, epoch_only: bool) -> None:
        self._epoch_only = epoch_only

    @property
    def epoch_only(self) -> bool:
        """Whether only the whole-epoch value is meaningful."""
        return self._epoch_only

    @abstractmethod
    def reset(self) -> None:
        """Forget what was accumulated (called at the start of an epoch)."""

    @abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Take one batch's values."""

    @abstractmethod
    def get_last_step_value(self) -> Any:
        """The value of the last batch."""

    @abstractmethod
    def get_accumulated_value(self) -> Any:
        """The value over everything since the last :meth:`reset`."""

    @staticmethod
    @abstractmethod
    def is_better(a: Any, b: Any) -> bool:
        """Whether value ``a`` is better than value ``b``."""


class LossMetric(Metric):
    """The loss: the last batch's, and the mean over the epoch's batches, both averaged over the
    DATA group (the loss of the global batch).

    Example:
        >>> metric = LossMetric(epoch_only=False)
        >>> metric.update(torch.tensor(2.0)); metric.update(torch.tensor(4.0))
        >>> metric.get_accumulated_value()
        3.0
    """

    def __init__(self, epoch_only: bool) -> None:
        super().__init__(epoch_only=epoch_only)
        self.last_step_loss = metric_tensor()
        self.accum_loss = metric_tensor()
        self.count = 0

    def reset(self) -> None:
        """Zero the last and accumulated loss and the batch count."""
        self.last_step_loss.zero_()
        self.accum_loss.zero_()
        self.count = 0

    def update(self, loss: torch.Tensor) -> None:
        """Take one batch's loss (a scalar tensor or number)."""
        if loss is None:
            raise ValueError("LossMetric.update got loss=None; the schedule must return the loss.")
        value = torch.as_tensor(loss).detach().to(self.accum_loss).reshape(-1)[:1]
        self.last_step_loss.copy_(value)
        self.accum_loss.add_(value)
        self.count += 1

    def get_last_step_value(self) -> float:
        """The last batch's loss, averaged over the DATA group. COLLECTIVE (DATA group)."""
        return float(reduce_over_data(self.last_step_loss).item()) / data_parallel_size()

    def get_accumulated_value(self) -> float:
        """The mean loss since :meth:`reset` over all ranks' batches. COLLECTIVE (DATA group).

        Raises:
            RuntimeError: no batch was seen since the last reset.
        """
        total = reduce_over_data(torch.cat([self.accum_loss, metric_tensor(self.count)]))
        if total[1].item() == 0:
            raise RuntimeError(
                "LossMetric has seen no batch since its last reset; nothing to average."
            )
        return float((total[0] / total[1]).item())

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """A lower loss is better."""
        return a < b


class LearningRateMetric(Metric):
    """The learning rate, as the :class:`LRSchedulerHook` last read it.

    Args:
        epoch_only: whether the rate changes once per epoch only.
        initial_lr: the rate before the first scheduler step.

    Example:
        >>> LearningRateMetric(epoch_only=True, initial_lr=0.1).get_accumulated_value()
        0.1
    """

    def __init__(self, epoch_only: bool, initial_lr: float = 0.0) -> None:
        super().__init__(epoch_only=epoch_only)
        self.lr = initial_lr

    def reset(self) -> None:
        """Nothing to forget: the rate stays."""

    def update(self, lr: float) -> None:
        """Take the current learning rate."""
        self.lr = lr

    def get_last_step_value(self) -> float:
        """The current learning rate."""
        return self.lr

    def get_accumulated_value(self) -> float:
        """The current learning rate."""
        return self.lr

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """Learning rates are not ranked: always ``False``."""
        return False


class AccuracyMetric(Metric):
    """Classification accuracy: correct predictions over samples, both summed over the DATA
    group (the accuracy of the global batch).

    Args:
        epoch_only: whether only the epoch's accuracy is meaningful.
        accuracy_func: ``accuracy_func(logits, targets)`` → the number of correct predictions
            (e.g. :class:`kolossos.legacy.nn.metric.Accuracy`).

    Example:
        >>> metric = AccuracyMetric(True, lambda o, y: (o.argmax(-1) == y).sum())
        >>> metric.update(torch.eye(2), torch.tensor([0, 0]), 2)
        >>> metric.get_accumulated_value()
        0.5
    """

    def __init__(self, epoch_only: bool, accuracy_func: Callable[..., Any]) -> None:
        super().__init__(epoch_only=epoch_only)
        self.acc = accuracy_func
        self.last_step = metric_tensor().repeat(2)  # (correct, samples)
        self.accumulated = metric_tensor().repeat(2)

    def reset(self) -> None:
        """Zero the counts."""
        self.last_step.zero_()
        self.accumulated.zero_()

    def update(self, logits: Any, targets: Any, batch_size: int) -> None:
        """Count the batch's correct predictions (``accuracy_func(logits, targets)``) out of
        ``batch_size`` samples."""
        correct = self.acc(logits, targets)
        self.last_step[0] = float(torch.as_tensor(correct).item())
        self.last_step[1] = float(batch_size)
        self.accumulated.add_(self.last_step)

    @staticmethod
    def _ratio(counts: torch.Tensor) -> float:
        total = reduce_over_data(counts)
        if total[1].item() == 0:
            raise RuntimeError("AccuracyMetric has counted no sample since its last reset.")
        return float((total[0] / total[1]).item())

    def get_last_step_value(self) -> Any:
        """The last global batch's accuracy, formatted. COLLECTIVE (DATA group)."""
        return format_number(self._ratio(self.last_step))

    def get_accumulated_value(self) -> float:
        """The accuracy since :meth:`reset` over all ranks. COLLECTIVE (DATA group)."""
        return self._ratio(self.accumulated)

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """A higher accuracy is better."""
        return a > b


class ThroughputMetric(Metric):
    """Samples per second: the samples of all ranks over the mean step time of the ranks.

    Args:
        epoch_only: whether only the epoch's value is meaningful.
        ignored_steps: the first steps to leave out of the accumulated value (warm-up).
        tflop_per_step: when positive, :meth:`get_last_step_info` also reports TFLOPS.
        use_local: use this rank's time and assume every rank processed as many samples (no
            communication).

    Example:
        >>> metric = ThroughputMetric(epoch_only=True)
        >>> metric.update(8, 2.0)
        >>> round(metric.get_accumulated_value())
        4
    """

    def __init__(
        self,
        epoch_only: bool,
        ignored_steps: int = 0,
        tflop_per_step: float = 0,
        use_local: bool = False,
    ) -> None:
        super().__init__(epoch_only=epoch_only)
        self.ignored_steps = ignored_steps
        self.cur_steps = 0
        self.last_step = metric_tensor().repeat(2)  # (samples, seconds)
        self.accumulated = metric_tensor().repeat(2)
        self._tflop_per_step = tflop_per_step
        self._use_local = use_local

    def reset(self) -> None:
        """Zero the sample and time sums (the ignored warm-up steps stay counted)."""
        self.last_step.zero_()
        self.accumulated.zero_()

    def update(self, num_samples: int, time: float) -> None:
        """Take one step's sample count (on this rank) and duration in seconds."""
        self.cur_steps += 1
        self.last_step[0] = float(num_samples)
        self.last_step[1] = float(time)
        if self.cur_steps > self.ignored_steps:
            self.accumulated.add_(self.last_step)

    def _global(self, counts: torch.Tensor) -> tuple[float, float]:
        size = data_parallel_size()
        if self._use_local:
            return float(counts[0].item()) * size, float(counts[1].item())
        total = reduce_over_data(counts)
        return float(total[0].item()), float(total[1].item()) / size

    def get_last_step_value(self) -> Any:
        """The last step's samples per second, formatted. COLLECTIVE unless ``use_local``."""
        samples, seconds = self._global(self.last_step)
        return format_number(samples / (seconds + 1e-12))

    def get_last_step_info(self) -> str:
        """``"<n> sample_per_sec"`` (plus TFLOPS when ``tflop_per_step`` is set). COLLECTIVE
        unless ``use_local``."""
        samples, seconds = self._global(self.last_step)
        info = f"{format_number(samples / (seconds + 1e-12))} sample_per_sec"
        if self._tflop_per_step > 0:
            info += f", {format_number(self._tflop_per_step / (seconds + 1e-12))} Tflops"
        return info

    def get_accumulated_value(self) -> float:
        """Samples per second since :meth:`reset`. COLLECTIVE unless ``use_local``."""
        samples, seconds = self._global(self.accumulated)
        return samples / (seconds + 1e-12)

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """A higher throughput is better."""
        return a > b
