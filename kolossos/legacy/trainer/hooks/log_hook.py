"""The logging hooks: :class:`LogMetricByStepHook` (per-step values for the progress bar),
:class:`LogMetricByEpochHook` (the metrics of each epoch) and :class:`LogTimingByEpochHook`
(the trainer's timers), on top of :class:`LogByEpochHook`.

Reading a metric is COLLECTIVE over the DATA group (see :mod:`.metrics`), so these hooks read on
every rank and write on one: the first rank of the DATA and TENSOR groups, on the last pipeline
stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kolossos.legacy.registry import HOOKS
from kolossos.legacy.trainer.hooks._common import format_number, is_rank_to_log
from kolossos.legacy.trainer.hooks.base_hook import BaseHook
from kolossos.legacy.trainer.hooks.metrics import ThroughputMetric
from kolossos.logging import DistributedLogger, get_dist_logger
from kolossos.utils.timer import MultiTimer

if TYPE_CHECKING:
    from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["LogByEpochHook", "LogMetricByEpochHook", "LogMetricByStepHook", "LogTimingByEpochHook"]


def _metrics(trainer: Trainer, mode: str) -> dict[str, Any]:
    metrics: dict[str, dict[str, Any]] = trainer.states.get("metrics", {})
    return metrics.get(mode, {})


class LogByEpochHook(BaseHook):
    """Base of the hooks that log every ``interval`` epochs (epochs whose 0-based index is a
    multiple of ``interval``, as upstream).

    Args:
        logger: where to log (``None``: :func:`kolossos.logging.get_dist_logger`).
        interval: log every this many epochs.
        priority: the place among the trainer's hooks (default 1).

    Raises:
        ValueError: ``interval`` is not a positive integer.
        TypeError: ``logger`` has no ``info`` method.

    Example:
        >>> class LogEpochHook(LogByEpochHook):
        ...     def after_train_epoch(self, trainer):
        ...         if self._is_epoch_to_log(trainer):
        ...             self.logger.info(f"epoch {trainer.cur_epoch} done")
    """

    def __init__(
        self, logger: DistributedLogger | None = None, interval: int = 1, priority: int = 1
    ) -> None:
        super().__init__(priority)
        name = type(self).__name__
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"{name}(interval={interval!r}): the interval must be an integer >= 1 (log every "
                "interval-th epoch); use interval=1 to log every epoch."
            )
        if logger is not None and not callable(getattr(logger, "info", None)):
            raise TypeError(
                f"{name}: the logger ({type(logger).__name__}) has no info() method; pass "
                "kolossos.logging.get_dist_logger()."
            )
        self.logger = logger if logger is not None else get_dist_logger()
        self._interval = interval

    def _is_epoch_to_log(self, trainer: Trainer) -> bool:
        return trainer.cur_epoch % self._interval == 0


@HOOKS.register_module
class LogMetricByStepHook(BaseHook):
    """After each iteration, puts every metric's last-step value in
    ``trainer.states["step_metrics"]`` (lower-case names), which the progress bar shows.
    COLLECTIVE over the DATA group each step.

    Args:
        priority: the place among the trainer's hooks (default 10: after the metric hooks).

    Example:
        >>> hooks = [LossHook(), ThroughputHook(), LogMetricByStepHook()]
        >>> trainer.fit(train_loader, epochs=1, hooks=hooks, display_progress=True)
    """

    def __init__(self, priority: int = 10) -> None:
        super().__init__(priority)

    @staticmethod
    def _collect(trainer: Trainer, mode: str) -> None:
        values: dict[str, Any] = {}
        for name, metric in _metrics(trainer, mode).items():
            if isinstance(metric, ThroughputMetric):
                values[name.lower()] = metric.get_last_step_info()
            else:
                values[name.lower()] = metric.get_last_step_value()
        trainer.states["step_metrics"] = values

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Read the train metrics' last-step values."""
        self._collect(trainer, "train")

    def after_test_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Read the test metrics' last-step values."""
        self._collect(trainer, "test")


@HOOKS.register_module
class LogMetricByEpochHook(LogByEpochHook):
    """Logs every metric's epoch value after each (``interval``-th) training epoch and
    evaluation, as ``[Epoch 3 / Train]: Loss = 0.51 | LR = 0.09`` and
    ``[Epoch 3 / Test]: Loss = 0.62 | Accuracy = 0.81``.

    Args:
        logger: where to log (``None``: the default distributed logger).
        interval: log every this many epochs.
        priority: the place among the trainer's hooks (default 10: after the metric hooks).

    Example:
        >>> logger = get_dist_logger()
        >>> hooks = [LossHook(), AccuracyHook(Accuracy()), LogMetricByEpochHook(logger)]
    """

    def __init__(
        self, logger: DistributedLogger | None = None, interval: int = 1, priority: int = 10
    ) -> None:
        super().__init__(logger, interval, priority)

    @staticmethod
    def _get_str(trainer: Trainer, mode: str) -> str:
        parts = []
        for name, metric in _metrics(trainer, mode).items():
            parts.append(f"{name} = {format_number(metric.get_accumulated_value())}")
        return " | ".join(parts)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log the train metrics (read on every rank, written on one)."""
        if self._is_epoch_to_log(trainer):
            msg = self._get_str(trainer, "train")
            if is_rank_to_log():
                self.logger.info(f"[Epoch {trainer.cur_epoch} / Train]: {msg}")

    def after_test_epoch(self, trainer: Trainer) -> None:
        """Log the test metrics (read on every rank, written on one)."""
        if self._is_epoch_to_log(trainer):
            msg = self._get_str(trainer, "test")
            if is_rank_to_log():
                self.logger.info(f"[Epoch {trainer.cur_epoch} / Test]: {msg}")


@HOOKS.register_module
class LogTimingByEpochHook(LogByEpochHook):
    """Logs the trainer's timers after each (``interval``-th) epoch: ``Train-epoch`` and
    ``Train-step`` (last and mean seconds) after training, ``Test-*`` after evaluation.

    Args:
        timer: the :class:`~kolossos.utils.timer.MultiTimer` also given to
            ``Trainer(timer=...)``.
        logger: where to log.
        interval: log every this many epochs.
        priority: the place among the trainer's hooks (default 10).
        log_eval: also log after evaluations.
        ignore_num_train_steps: leave the first training steps out of the mean step time.

    Raises:
        TypeError: ``timer`` is not a ``MultiTimer``.
        ValueError: (when attached) the trainer was built without this timer.

    Example:
        >>> timer = MultiTimer()
        >>> trainer = Trainer(engine, timer=timer, logger=logger)
        >>> trainer.fit(loader, epochs=2, hooks=[LogTimingByEpochHook(timer, logger)])
    """

    def __init__(
        self,
        timer: MultiTimer,
        logger: DistributedLogger | None = None,
        interval: int = 1,
        priority: int = 10,
        log_eval: bool = True,
        ignore_num_train_steps: int = 0,
    ) -> None:
        super().__init__(logger=logger, interval=interval, priority=priority)
        if not isinstance(timer, MultiTimer):
            raise TypeError(
                f"LogTimingByEpochHook(timer={timer!r}): pass the kolossos.utils.MultiTimer "
                "that was given to Trainer(timer=...)."
            )
        if ignore_num_train_steps < 0:
            raise ValueError(f"ignore_num_train_steps={ignore_num_train_steps} must be >= 0.")
        self._timer = timer
        self._log_eval = log_eval
        self._ignore_num_train_steps = ignore_num_train_steps

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Check that the trainer runs this hook's timer."""
        if trainer.timer is not self._timer:
            raise ValueError(
                "LogTimingByEpochHook's timer is not the trainer's (Trainer(timer=...) is "
                f"{trainer.timer!r}), so nothing would be timed; pass the same MultiTimer to both."
            )

    def _get_message(self, mode: str) -> str:
        parts = []
        for name, timer in self._timer:
            if not name.startswith(mode):
                continue
            last = format_number(timer.get_elapsed_time())
            history = timer.history
            if name == "Train-step":
                history = history[self._ignore_num_train_steps :]
            if history:
                mean = format_number(sum(history) / len(history))
                parts.append(f"{name}: last = {last} s, mean = {mean} s")
            else:
                parts.append(f"{name}: last = {last} s")
        return " | ".join(parts)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log the training timers."""
        if self._is_epoch_to_log(trainer) and is_rank_to_log():
            msg = self._get_message("Train")
            self.logger.info(
                f"[Epoch {trainer.cur_epoch} / Train]: {msg} | "
                f"#steps/epoch = {trainer.steps_per_epoch}"
            )

    def after_test_epoch(self, trainer: Trainer) -> None:
        """Log the evaluation timers (with ``log_eval``)."""
        if self._log_eval and self._is_epoch_to_log(trainer) and is_rank_to_log():
            self.logger.info(f"[Epoch {trainer.cur_epoch} / Test]: {self._get_message('Test')}")
