"""The metric hooks: :class:`MetricHook` (their base), :class:`LossHook`, :class:`AccuracyHook`
and :class:`ThroughputHook`. Each registers a collector of :mod:`.metrics` in
``trainer.states["metrics"]["train" | "test"]`` under a display name and feeds it batches; the
logging hooks read them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kolossos.accelerator import get_accelerator
from kolossos.legacy.registry import HOOKS
from kolossos.legacy.trainer.hooks.base_hook import BaseHook
from kolossos.legacy.trainer.hooks.metrics import AccuracyMetric, LossMetric, ThroughputMetric
from kolossos.legacy.utils.parallel_state import is_no_pp_or_last_stage

if TYPE_CHECKING:
    from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["AccuracyHook", "LossHook", "MetricHook", "ThroughputHook"]


class MetricHook(BaseHook):
    """Base of the hooks that keep a metric collector in ``trainer.states["metrics"]`` (a dict
    ``{"train": {name: Metric}, "test": {name: Metric}}`` created by the first such hook).

    Only the last pipeline stage (every rank without a pipeline) computes metrics.

    Args:
        priority: the place among the trainer's hooks (lower runs first).

    Example:
        >>> class StepCountHook(MetricHook):
        ...     def after_hook_is_attached(self, trainer):
        ...         self._check_metric_states_initialization(trainer)
    """

    def __init__(self, priority: int) -> None:
        super().__init__(priority)

    @property
    def _is_stage_to_compute(self) -> bool:
        return is_no_pp_or_last_stage()

    def _check_metric_states_initialization(self, trainer: Trainer) -> None:
        self.init_runner_states(trainer, "metrics", {"train": {}, "test": {}})


@HOOKS.register_module
class LossHook(MetricHook):
    """Records the loss: ``"Loss"`` in the train metrics (per step and per epoch) and in the test
    metrics (per epoch), averaged over the DATA group.

    Args:
        priority: the place among the trainer's hooks (default 0: early).

    Example:
        >>> trainer.fit(train_loader, epochs=2, hooks=[LossHook(), LogMetricByEpochHook(logger)])
    """

    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self.train_loss = LossMetric(epoch_only=False)
        self.test_loss = LossMetric(epoch_only=True)

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register ``"Loss"`` in the train and test metrics."""
        self._check_metric_states_initialization(trainer)
        if self._is_stage_to_compute:
            trainer.states["metrics"]["train"]["Loss"] = self.train_loss
            trainer.states["metrics"]["test"]["Loss"] = self.test_loss

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Start the epoch's mean afresh."""
        if self._is_stage_to_compute:
            self.train_loss.reset()

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Take the iteration's loss."""
        if self._is_stage_to_compute:
            self.train_loss.update(loss)

    def before_test_epoch(self, trainer: Trainer) -> None:
        """Start the evaluation's mean afresh."""
        if self._is_stage_to_compute:
            self.test_loss.reset()

    def after_test_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Take the test batch's loss."""
        if self._is_stage_to_compute:
            self.test_loss.update(loss)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def batch_size_of(trainer: Trainer, output: Any) -> int:
    """This rank's batch size: the engine's schedule's (as upstream), else the output's rows."""
    size = getattr(trainer.engine.schedule, "batch_size", None)
    if isinstance(size, int):
        return size
    first = _first(output)
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.size(0))
    raise RuntimeError(
        "cannot tell the batch size: the schedule has none and the output is no tensor."
    )


@HOOKS.register_module
class AccuracyHook(MetricHook):
    """Records ``"Accuracy"`` in the test metrics: the correct predictions counted by
    ``accuracy_func`` over the samples of every rank of the DATA group.

    As upstream, an output or label that is a list or tuple is reduced to its first element,
    except for an ``accuracy_func`` whose ``accepts_structured_targets`` attribute is true (such
    as :class:`~kolossos.legacy.nn.metric.MixupAccuracy`), which receives the labels whole.

    Args:
        accuracy_func: ``accuracy_func(logits, targets)`` → the number of correct predictions
            in the batch (e.g. :class:`kolossos.legacy.nn.metric.Accuracy`).
        priority: the place among the trainer's hooks (default 0: early).

    Raises:
        TypeError: ``accuracy_func`` is not callable.
        RuntimeError: (during evaluation) ``fit``/``evaluate`` ran with
            ``return_output_label=False``, so there is nothing to score.

    Example:
        >>> from kolossos.legacy.nn.metric import Accuracy
        >>> hooks = [LossHook(), AccuracyHook(accuracy_func=Accuracy())]
    """

    def __init__(self, accuracy_func: Callable[..., Any], priority: int = 0) -> None:
        super().__init__(priority)
        if not callable(accuracy_func):
            raise TypeError(
                f"AccuracyHook(accuracy_func={accuracy_func!r}): it must be callable as "
                "accuracy_func(logits, targets) -> number of correct predictions, e.g. Accuracy()."
            )
        self.accuracy_func = accuracy_func
        self.metric = AccuracyMetric(epoch_only=True, accuracy_func=accuracy_func)

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register ``"Accuracy"`` in the test metrics."""
        self._check_metric_states_initialization(trainer)
        if self._is_stage_to_compute:
            trainer.states["metrics"]["test"]["Accuracy"] = self.metric

    def before_test(self, trainer: Trainer) -> None:
        """Start the evaluation's counts afresh."""
        if self._is_stage_to_compute:
            self.metric.reset()

    def after_test_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Count the test batch's correct predictions."""
        if not self._is_stage_to_compute:
            return
        if output is None or label is None:
            raise RuntimeError(
                "AccuracyHook needs the model's output and the labels, but the trainer ran with "
                "return_output_label=False; pass return_output_label=True to fit()/evaluate()."
            )
        if not getattr(self.accuracy_func, "accepts_structured_targets", False):
            label = _first(label)
        self.metric.update(_first(output), label, batch_size_of(trainer, output))


@HOOKS.register_module
class ThroughputHook(MetricHook):
    """Records ``"Throughput"`` (samples per second over the DATA group) in the train and test
    metrics. Each step is timed from this hook's ``before_*_iter`` to its ``after_*_iter``,
    after synchronising the accelerator.

    Args:
        ignored_steps: the first training steps to leave out (warm-up).
        priority: the place among the trainer's hooks (default 10).
        tflop_per_step: when positive, the step log also shows TFLOPS.
        use_local: use this rank's time and assume equal batches on every rank (no
            communication).

    Raises:
        ValueError: ``ignored_steps`` is negative.

    Example:
        >>> hooks = [LossHook(), ThroughputHook(ignored_steps=5), LogMetricByStepHook()]
    """

    def __init__(
        self,
        ignored_steps: int = 0,
        priority: int = 10,
        tflop_per_step: float = 0,
        use_local: bool = False,
    ) -> None:
        super().__init__(priority)
        if ignored_steps < 0:
            raise ValueError(f"ThroughputHook(ignored_steps={ignored_steps}) must be >= 0.")
        self.ignored_steps = ignored_steps
        self.metric = ThroughputMetric(
            epoch_only=True,
            ignored_steps=ignored_steps,
            tflop_per_step=tflop_per_step,
            use_local=use_local,
        )
        self._start = 0.0

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register ``"Throughput"`` in the train and test metrics."""
        self._check_metric_states_initialization(trainer)
        if self._is_stage_to_compute:
            trainer.states["metrics"]["train"]["Throughput"] = self.metric
            trainer.states["metrics"]["test"]["Throughput"] = self.metric

    def _tic(self) -> None:
        get_accelerator().synchronize()  # SYNC POINT: start after the queued device work
        self._start = time.perf_counter()

    def _toc(self, trainer: Trainer, output: Any) -> None:
        get_accelerator().synchronize()  # SYNC POINT: count the step's device work
        elapsed = time.perf_counter() - self._start
        self.metric.update(batch_size_of(trainer, output), elapsed)

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Start the epoch's sums afresh."""
        if self._is_stage_to_compute:
            self.metric.reset()

    def before_train_iter(self, trainer: Trainer) -> None:
        """Start timing the step."""
        if self._is_stage_to_compute:
            self._tic()

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Count the step's samples and time."""
        if self._is_stage_to_compute:
            self._toc(trainer, output)

    def before_test(self, trainer: Trainer) -> None:
        """Start the evaluation's sums afresh."""
        if self._is_stage_to_compute:
            self.metric.reset()

    def before_test_iter(self, trainer: Trainer) -> None:
        """Start timing the batch."""
        if self._is_stage_to_compute:
            self._tic()

    def after_test_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Count the batch's samples and time."""
        if self._is_stage_to_compute:
            self._toc(trainer, output)
