"""``BaseHook``: the lifecycle a :class:`~kolossos.legacy.trainer.Trainer` calls its hooks at."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["BaseHook"]


class BaseHook:
    """Actions at fixed points of training and evaluation: subclass it and override the
    methods you need (each does nothing by default).

    ``Trainer.fit`` calls, in order: ``after_hook_is_attached``, ``before_train``, then per
    epoch ``before_train_epoch``, per iteration ``before_train_iter`` /
    ``after_train_iter(trainer, output, label, loss)``, ``after_train_epoch``, then (on test
    epochs) ``before_test``, ``before_test_epoch``, per batch ``before_test_iter`` /
    ``after_test_iter(trainer, output, label, loss)``, ``after_test_epoch``, ``after_test``;
    finally ``after_train``. At each point the hooks run by ascending ``priority`` (a lower value
    runs first; equal priorities keep the order of the list given to ``fit``).

    Args:
        priority: the place among the trainer's hooks (lower runs first).

    Raises:
        TypeError: ``priority`` is not a number.

    Example:
        >>> class LogMessageHook(BaseHook):
        ...     def __init__(self, priority=10):
        ...         super().__init__(priority)
        ...         self._logger = get_dist_logger()
        ...     def before_train(self, trainer):
        ...         self._logger.info("training starts")
        ...     def after_train(self, trainer):
        ...         self._logger.info("training finished")
    """

    def __init__(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, (int, float)):
            raise TypeError(
                f"{type(self).__name__}(priority={priority!r}): the priority must be a number "
                "(lower runs first), e.g. priority=10."
            )
        self.priority = priority

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Called once the trainer holds its hooks (at the start of ``fit``/``evaluate``)."""

    def before_train(self, trainer: Trainer) -> None:
        """Called before the first training epoch."""

    def after_train(self, trainer: Trainer) -> None:
        """Called after the last training epoch (and its evaluation)."""

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Called before each training epoch."""

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Called after each training epoch (``trainer.cur_epoch`` is still its index)."""

    def before_train_iter(self, trainer: Trainer) -> None:
        """Called before each training iteration."""

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Called after each training iteration (after ``engine.step()``).

        Args:
            trainer: the trainer running the hook.
            output: the model's output (``None`` with ``return_output_label=False``).
            label: the batch's labels (``None`` with ``return_output_label=False``).
            loss: the iteration's loss on this rank.
        """

    def before_test(self, trainer: Trainer) -> None:
        """Called before an evaluation."""

    def after_test(self, trainer: Trainer) -> None:
        """Called after an evaluation."""

    def before_test_epoch(self, trainer: Trainer) -> None:
        """Called before the evaluation's pass over the test data."""

    def after_test_epoch(self, trainer: Trainer) -> None:
        """Called after the evaluation's pass over the test data."""

    def before_test_iter(self, trainer: Trainer) -> None:
        """Called before each evaluation batch."""

    def after_test_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Called after each evaluation batch (arguments as :meth:`after_train_iter`)."""

    def init_runner_states(self, trainer: Trainer, key: str, val: Any) -> None:
        """Set ``trainer.states[key] = val`` unless another hook set it already."""
        if key not in trainer.states:
            trainer.states[key] = val
