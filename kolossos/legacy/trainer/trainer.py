"""``Trainer``: Colossal-AI's legacy training loop over an :class:`~kolossos.legacy.engine.Engine`,
with hooks at fixed points of the loop."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kolossos.legacy.trainer.hooks.base_hook import BaseHook
from kolossos.legacy.trainer.progress import make_progress
from kolossos.legacy.utils.parallel_state import is_dp_rank_0, is_no_pp_or_last_stage, is_tp_rank_0
from kolossos.logging import DistributedLogger
from kolossos.utils.timer import MultiTimer

if TYPE_CHECKING:
    from kolossos.legacy.engine import Engine

__all__ = ["Trainer"]

_ENGINE_METHODS = ("execute_schedule", "zero_grad", "step", "train", "eval")


def _check_count(name: str, value: Any, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or None (no limit)" if allow_none else ""
        raise ValueError(f"Trainer.fit({name}={value!r}): {name} must be an integer >= 1{extra}.")


def _length(name: str, loader: Any) -> int:
    try:
        size = len(loader)
    except TypeError:
        raise TypeError(
            f"{name} ({type(loader).__name__}) has no len(); the trainer runs len({name}) steps "
            "per pass: pass a DataLoader (e.g. from kolossos.utils.get_dataloader) or a list."
        ) from None
    if size == 0:
        raise ValueError(
            f"{name} is empty (len 0): there is nothing to run; check the dataset size, the "
            "batch size and drop_last."
        )
    return size


def _check_hooks(hooks: Sequence[BaseHook] | None) -> list[BaseHook]:
    if hooks is None:
        return []
    if not isinstance(hooks, (list, tuple)):
        raise TypeError(
            f"hooks must be a list of BaseHook objects, got {type(hooks).__name__}; write "
            "hooks=[LossHook(), ...]."
        )
    for i, hook in enumerate(hooks):
        if not isinstance(hook, BaseHook):
            raise TypeError(
                f"hooks[{i}] is a {type(hook).__name__}, not a BaseHook; pass instances of the "
                "hooks in kolossos.trainer.hooks, or of your own BaseHook subclass (note the "
                "parentheses: LossHook(), not LossHook)."
            )
    return sorted(hooks, key=lambda hook: hook.priority)  # stable: ties keep the list order


class Trainer:
    """Trains and evaluates an Engine: ``fit`` runs epochs of ``engine.zero_grad()``,
    ``engine.execute_schedule(...)``, ``engine.step()``, with evaluation every ``test_interval``
    epochs and :class:`~kolossos.legacy.trainer.hooks.BaseHook` objects called around every
    step, epoch and pass.

    Args:
        engine: the :class:`~kolossos.legacy.engine.Engine` from ``kolossos.initialize``.
        timer: a :class:`~kolossos.utils.timer.MultiTimer`; the trainer times ``Train-epoch``,
            ``Train-step``, ``Test-epoch`` and ``Test-step`` in it.
        logger: a :class:`~kolossos.logging.DistributedLogger`; when given, the trainer logs the
            hooks it runs and an early stop.

    Attributes:
        states: a dict hooks share (``states["metrics"]`` holds the metric collectors,
            ``states["step_metrics"]`` what the progress bar shows).
        hooks: the hooks of the running ``fit``/``evaluate``, in calling order.

    Raises:
        TypeError: ``engine`` lacks an Engine method, ``timer`` is not a ``MultiTimer``, or
            ``logger`` has no ``info``.

    Example:
        >>> engine, train_dataloader, test_dataloader, _ = kolossos.initialize(
        ...     model, optimizer, criterion, train_dataloader, test_dataloader)
        >>> trainer = Trainer(engine=engine, logger=get_dist_logger(), timer=MultiTimer())
        >>> trainer.fit(train_dataloader=train_dataloader, epochs=NUM_EPOCHS,
        ...             test_dataloader=test_dataloader, test_interval=1,
        ...             hooks=[hooks.LossHook(), hooks.LogMetricByEpochHook(logger)],
        ...             display_progress=True)
    """

    def __init__(
        self,
        engine: Engine,
        timer: MultiTimer | None = None,
        logger: DistributedLogger | None = None,
    ) -> None:
        missing = [m for m in _ENGINE_METHODS if not callable(getattr(engine, m, None))]
        if missing:
            raise TypeError(
                f"Trainer(engine=...) got a {type(engine).__name__} without {', '.join(missing)}; "
                "pass the Engine returned by kolossos.initialize(model, optimizer, criterion, ...)."
            )
        if timer is not None and not isinstance(timer, MultiTimer):
            raise TypeError(
                f"Trainer(timer=...) got a {type(timer).__name__}; pass a "
                "kolossos.utils.MultiTimer() or None."
            )
        if logger is not None and not callable(getattr(logger, "info", None)):
            raise TypeError(
                f"Trainer(logger=...) got a {type(logger).__name__} without info(); pass "
                "kolossos.logging.get_dist_logger() or None."
            )
        self._engine = engine
        self._timer = timer
        self._logger = logger
        self._verbose = logger is not None
        self._max_epochs = 0
        self._cur_epoch = 0
        self._max_steps: int | None = None
        self._cur_step = 0
        self._steps_per_epoch = 0
        self.states: dict[str, Any] = {}
        self.hooks: list[BaseHook] = []

    # ------------------------------------------------------------------ state
    @property
    def cur_epoch(self) -> int:
        """The index of the current epoch (the number of finished epochs between epochs)."""
        return self._cur_epoch

    @cur_epoch.setter
    def cur_epoch(self, epoch: int) -> None:
        """Set the epoch to resume from (``fit`` then starts there)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"cur_epoch={epoch!r} must be an integer >= 0.")
        self._cur_epoch = epoch

    @property
    def cur_step(self) -> int:
        """The number of training iterations done."""
        return self._cur_step

    @property
    def max_epochs(self) -> int:
        """``fit``'s ``epochs``."""
        return self._max_epochs

    @property
    def max_steps(self) -> int | None:
        """``fit``'s ``max_steps`` (``None``: no limit)."""
        return self._max_steps

    @property
    def steps_per_epoch(self) -> int:
        """Iterations per epoch: ``len(train_dataloader)``."""
        return self._steps_per_epoch

    @property
    def engine(self) -> Engine:
        """The Engine being trained."""
        return self._engine

    @property
    def timer(self) -> MultiTimer | None:
        """The trainer's timers (``None`` when none was given)."""
        return self._timer

    @property
    def logger(self) -> DistributedLogger | None:
        """The trainer's logger (``None`` when none was given)."""
        return self._logger

    # ------------------------------------------------------------------ internals
    def _call_timer(self, action: str, item: str, **kwargs: Any) -> None:
        if self._timer is None:
            return
        if action == "reset" and item not in dict(iter(self._timer)):
            return  # never started (e.g. no epoch ran): nothing to reset
        getattr(self._timer, action)(item, **kwargs)

    def _call_hooks(self, func: str, output: tuple[Any, Any, Any] | None = None) -> None:
        for hook in self.hooks:
            if output is None:
                getattr(hook, func)(self)
            else:
                getattr(hook, func)(self, *output)

    @staticmethod
    def _should_display_progress(display_progress: bool) -> bool:
        """Only the first rank of the DATA and TENSOR groups, on the last pipeline stage."""
        return (
            bool(display_progress)
            and is_dp_rank_0()
            and is_tp_rank_0()
            and is_no_pp_or_last_stage()
        )

    def _attach(self, hooks: Sequence[BaseHook] | None) -> None:
        self.states = {}
        self.hooks = _check_hooks(hooks)
        if self._verbose:
            assert self._logger is not None
            for hook in self.hooks:
                self._logger.info(
                    f"Using {type(hook).__name__} for training, priority = {hook.priority}",
                    ranks=[0],
                )
            self._logger.info(
                "Lower value means higher priority for calling hook function", ranks=[0]
            )
        self._call_hooks("after_hook_is_attached")

    def _exceed_max_step(self) -> bool:
        return self._max_steps is not None and self._cur_step >= self._max_steps

    @staticmethod
    def _next_step(data_iter: Iterator[Any], run: Any, name: str, expected: int) -> Any:
        try:
            return run(data_iter)
        except StopIteration:
            raise RuntimeError(
                f"{name} ran out of batches before the {expected} that len({name}) promised; "
                "give a dataloader whose len() matches what it yields."
            ) from None

    def _show(self, progress: Any) -> None:
        if "step_metrics" in self.states:
            progress.set_postfix(**self.states["step_metrics"])

    def _train_epoch(
        self, train_dataloader: Iterable[Any], epoch: int, display: bool, return_output_label: bool
    ) -> None:
        self._engine.train()
        sampler = getattr(train_dataloader, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]  # a new shuffle each epoch
        data_iter = iter(train_dataloader)
        progress = make_progress(self._steps_per_epoch, f"[Epoch {epoch} / Train]", display)

        def run(it: Iterator[Any]) -> Any:
            return self._engine.execute_schedule(
                it, forward_only=False, return_loss=True, return_output_label=return_output_label
            )

        self._call_hooks("before_train_epoch")
        self._call_timer("start", "Train-epoch")
        for _ in progress:
            self._call_hooks("before_train_iter")
            self._call_timer("start", "Train-step")
            self._engine.zero_grad()
            output, label, loss = self._next_step(
                data_iter, run, "train_dataloader", self._steps_per_epoch
            )
            self._engine.step()
            self._call_timer("stop", "Train-step", keep_in_history=True)
            self._call_hooks("after_train_iter", output=(output, label, loss))
            self._cur_step += 1
            self._show(progress)
            if self._exceed_max_step():
                break
        progress.close()
        self._call_timer("stop", "Train-epoch", keep_in_history=True)
        self._call_hooks("after_train_epoch")
        self._call_timer("reset", "Train-epoch")

    def _eval(
        self,
        test_dataloader: Iterable[Any],
        num_steps: int,
        epoch: int | None,
        display: bool,
        return_output_label: bool,
    ) -> None:
        self._engine.eval()
        data_iter = iter(test_dataloader)
        desc = "Evaluation" if epoch is None else f"[Epoch {epoch} / Test]"

        def run(it: Iterator[Any]) -> Any:
            return self._engine.execute_schedule(
                it, forward_only=True, return_loss=True, return_output_label=return_output_label
            )

        self._call_hooks("before_test")
        progress = make_progress(num_steps, desc, display)
        self._call_hooks("before_test_epoch")
        self._call_timer("start", "Test-epoch")
        with torch.no_grad():
            for _ in progress:
                self._call_hooks("before_test_iter")
                self._call_timer("start", "Test-step")
                output, label, loss = self._next_step(data_iter, run, "test_dataloader", num_steps)
                self._call_timer("stop", "Test-step", keep_in_history=True)
                self._call_hooks("after_test_iter", output=(output, label, loss))
                self._show(progress)
        progress.close()
        self._call_timer("stop", "Test-epoch", keep_in_history=True)
        self._call_hooks("after_test_epoch")
        self._call_hooks("after_test")
        self._call_timer("reset", "Test-step")
        self._call_timer("reset", "Test-epoch")

    # ------------------------------------------------------------------ public API
    def fit(
        self,
        train_dataloader: Iterable[Any],
        epochs: int,
        max_steps: int | None = None,
        test_dataloader: Iterable[Any] | None = None,
        test_interval: int = 1,
        hooks: Sequence[BaseHook] | None = None,
        display_progress: bool = False,
        return_output_label: bool = True,
    ) -> None:
        """Train for ``epochs`` epochs of ``len(train_dataloader)`` iterations (from
        ``cur_epoch``, so a resumed trainer continues), evaluating on ``test_dataloader`` after
        the epochs whose index is a multiple of ``test_interval`` (0, ``test_interval``, ...).

        A sampler with ``set_epoch`` (``DataParallelSampler``, ``DistributedSampler``) is told
        the epoch before each epoch, so shuffling differs between epochs.

        Args:
            train_dataloader: the training batches.
            epochs: the number of epochs.
            max_steps: stop after this many iterations in all (the epoch is cut short, then
                evaluated as usual); ``None``: no limit.
            test_dataloader: evaluation batches (``None``: no evaluation).
            test_interval: evaluate every this many epochs.
            hooks: the hooks to run (sorted by priority, lower first; ties keep this order).
            display_progress: show a progress bar (tqdm when installed) on the logging rank.
            return_output_label: pass the model's output and the labels to the hooks (needed by
                ``AccuracyHook``; ``False`` saves memory).

        Raises:
            ValueError: ``epochs``, ``max_steps`` or ``test_interval`` is not an integer >= 1,
                or a dataloader is empty.
            TypeError: a dataloader has no ``len()``, or a hook is not a ``BaseHook``.

        Example:
            >>> trainer.fit(train_dataloader, epochs=10, test_dataloader=test_dataloader,
            ...             hooks=[LossHook(), LogMetricByEpochHook(logger)])
        """
        _check_count("epochs", epochs)
        _check_count("max_steps", max_steps, allow_none=True)
        _check_count("test_interval", test_interval)
        steps = _length("train_dataloader", train_dataloader)
        test_steps = (
            None if test_dataloader is None else _length("test_dataloader", test_dataloader)
        )
        if test_dataloader is None and test_interval != 1:
            warnings.warn(
                f"Trainer.fit(test_interval={test_interval}) has no effect without a "
                "test_dataloader; pass test_dataloader=... to evaluate.",
                UserWarning,
                stacklevel=2,
            )
        if self._cur_epoch >= epochs:
            warnings.warn(
                f"Trainer.fit(epochs={epochs}) with cur_epoch={self._cur_epoch}: every epoch is "
                "done already, so nothing is trained; raise epochs to train more.",
                UserWarning,
                stacklevel=2,
            )
        self._steps_per_epoch = steps
        self._max_steps = max_steps
        self._max_epochs = epochs
        display = self._should_display_progress(display_progress)

        self._attach(hooks)
        self._engine.train()
        self._call_hooks("before_train")
        self._cur_step = self._cur_epoch * self._steps_per_epoch  # resuming: steps done so far
        for epoch in range(self._cur_epoch, epochs):
            self._train_epoch(train_dataloader, epoch, display, return_output_label)
            if test_dataloader is not None and test_steps and epoch % test_interval == 0:
                self._eval(test_dataloader, test_steps, epoch, display, return_output_label)
            self._cur_epoch += 1
            if self._exceed_max_step():
                if self._logger is not None:
                    self._logger.info(
                        f"Max number of steps {max_steps} has been reached, training is stopped "
                        "automatically",
                        ranks=[0],
                    )
                break
        self._call_hooks("after_train")
        self._call_timer("reset", "Train-epoch")

    def evaluate(
        self,
        test_dataloader: Iterable[Any],
        hooks: Sequence[BaseHook] | None = None,
        display_progress: bool = False,
        return_output_label: bool = True,
    ) -> None:
        """One pass over ``test_dataloader`` without gradients, with ``engine.eval()``, running
        the hooks' ``before_test`` ... ``after_test``.

        Args:
            test_dataloader: the evaluation batches.
            hooks: the hooks to run (sorted by priority).
            display_progress: show a progress bar on the logging rank.
            return_output_label: pass the model's output and the labels to the hooks.

        Raises:
            ValueError: the dataloader is empty.
            TypeError: it has no ``len()``, or a hook is not a ``BaseHook``.

        Example:
            >>> trainer.evaluate(test_dataloader, hooks=[LossHook(), AccuracyHook(Accuracy())])
            >>> trainer.states["metrics"]["test"]["Accuracy"].get_accumulated_value()
        """
        steps = _length("test_dataloader", test_dataloader)
        display = self._should_display_progress(display_progress)
        self._attach(hooks)
        self._eval(test_dataloader, steps, None, display, return_output_label)

    def predict(self, data: Any) -> Any:
        """The model's output for ``data`` (a tensor or a list of tensors), in eval mode and
        without gradients.

        Example:
            >>> logits = trainer.predict(torch.randn(4, 16))
        """
        self._engine.eval()
        with torch.no_grad():
            output, _, _ = self._engine.execute_schedule(
                iter([(data, None)]), forward_only=True, return_loss=False
            )
        return output
