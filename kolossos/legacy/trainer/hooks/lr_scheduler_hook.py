"""``LRSchedulerHook``: steps a learning-rate scheduler after each epoch or each iteration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kolossos.legacy.registry import HOOKS
from kolossos.legacy.trainer.hooks.metric_hook import MetricHook
from kolossos.legacy.trainer.hooks.metrics import LearningRateMetric

if TYPE_CHECKING:
    from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["LRSchedulerHook"]


@HOOKS.register_module
class LRSchedulerHook(MetricHook):
    """Calls ``lr_scheduler.step()`` after every training epoch (``by_epoch=True``) or after
    every training iteration (``by_epoch=False``), and records the first parameter group's rate
    as ``"LR"`` in the train metrics.

    Args:
        lr_scheduler: a scheduler with ``step()`` and ``get_last_lr()`` (a
            ``kolossos.nn.lr_scheduler`` or ``torch.optim.lr_scheduler`` one).
        by_epoch: step once per epoch (``True``) or once per iteration (``False``).
        store_lr_in_state: record ``"LR"`` in ``trainer.states["metrics"]["train"]``.
        priority: the place among the trainer's hooks (default 1).

    Raises:
        TypeError: ``by_epoch`` is not a bool, or the scheduler lacks ``step``/``get_last_lr``.

    Example:
        >>> lr_scheduler = CosineAnnealingLR(optimizer, total_steps=NUM_EPOCHS)
        >>> hooks = [LossHook(), LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=True)]
    """

    def __init__(
        self,
        lr_scheduler: Any,
        by_epoch: bool,
        store_lr_in_state: bool = True,
        priority: int = 1,
    ) -> None:
        super().__init__(priority=priority)
        if not isinstance(by_epoch, bool):
            raise TypeError(
                f"LRSchedulerHook(by_epoch={by_epoch!r}): by_epoch must be True (step the "
                "scheduler after each epoch) or False (after each iteration)."
            )
        missing = [
            m for m in ("step", "get_last_lr") if not callable(getattr(lr_scheduler, m, None))
        ]
        if missing:
            raise TypeError(
                f"LRSchedulerHook: {type(lr_scheduler).__name__} has no {' or '.join(missing)}(); "
                "pass a learning-rate scheduler, e.g. kolossos.nn.lr_scheduler.CosineAnnealingLR."
            )
        self.by_epoch = by_epoch
        self.lr_scheduler = lr_scheduler
        self.store_lr_in_state = store_lr_in_state
        self.metric = LearningRateMetric(epoch_only=by_epoch, initial_lr=self._current_lr())

    def _current_lr(self) -> float:
        return float(self.lr_scheduler.get_last_lr()[0])

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register ``"LR"`` in the train metrics (with ``store_lr_in_state``)."""
        self._check_metric_states_initialization(trainer)
        self.metric.update(self._current_lr())
        if self.store_lr_in_state:
            trainer.states["metrics"]["train"]["LR"] = self.metric

    def _step(self) -> None:
        self.lr_scheduler.step()
        self.metric.update(self._current_lr())

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Step the scheduler (``by_epoch=True``)."""
        if self.by_epoch:
            self._step()

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Step the scheduler (``by_epoch=False``)."""
        if not self.by_epoch:
            self._step()
