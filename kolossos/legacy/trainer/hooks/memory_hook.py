"""``LogMemoryByEpochHook``: logs the accelerator's memory use before training and after each
(``interval``-th) epoch and evaluation."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from kolossos.accelerator import get_accelerator
from kolossos.legacy.registry import HOOKS
from kolossos.legacy.trainer.hooks._common import is_rank_to_log
from kolossos.legacy.trainer.hooks.log_hook import LogByEpochHook
from kolossos.logging import DistributedLogger

if TYPE_CHECKING:
    from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["LogMemoryByEpochHook", "memory_usage_message"]

_MB = 1024**2


def memory_usage_message(prefix: str, report_cpu: bool = False) -> str:
    """One line on the accelerator's memory, then resets its peak (so each line's peak covers
    the time since the previous one).

    On a GPU: allocated, max allocated and reserved memory of the current device. On the CPU
    accelerator: the process's resident set size and its peak (or, inside a
    :class:`~kolossos.accelerator.TensorMemoryTracker`, the tracked tensor bytes).
    ``report_cpu`` adds the host's used virtual memory.

    Example:
        >>> memory_usage_message("Before-train")  # doctest: +ELLIPSIS
        'Before-train: CPU ...'
    """
    acc = get_accelerator()
    allocated = acc.memory_allocated() / _MB
    peak = acc.max_memory_allocated() / _MB
    if acc.name == "cpu":
        source = "RSS" if acc.memory_stats_source() == "rss" else "tracked tensors"
        line = f"{prefix}: CPU ({source}): current {allocated:.1f} MB, peak {peak:.1f} MB"
    else:
        reserved = acc.memory_reserved() / _MB
        line = (
            f"{prefix}: {acc.name.upper()}: allocated {allocated:.1f} MB, max allocated "
            f"{peak:.1f} MB, reserved {reserved:.1f} MB"
        )
    if report_cpu:
        import psutil  # a declared dependency; imported lazily

        gc.collect()  # count memory that is only waiting for the collector as free
        vm = psutil.virtual_memory()
        line += f", CPU virtual memory: used = {(vm.total - vm.available) / _MB:.1f} MB, "
        line += f"percent = {vm.percent}%"
    acc.reset_peak_memory_stats()
    return line


@HOOKS.register_module
class LogMemoryByEpochHook(LogByEpochHook):
    """Logs memory use before training (``Before-train: ...``), after each training epoch
    (``[Epoch 3 / Train]: ...``) and after each evaluation (``[Epoch 3 / Test]: ...``), every
    ``interval`` epochs, on the first rank of the DATA and TENSOR groups. See
    :func:`memory_usage_message` for the figures.

    Args:
        logger: where to log (``None``: the default distributed logger).
        interval: log every this many epochs.
        priority: the place among the trainer's hooks (default 10).
        log_eval: also log after evaluations.
        report_cpu: also log the host's used virtual memory.

    Example:
        >>> hooks = [LossHook(), LogMemoryByEpochHook(logger)]
    """

    def __init__(
        self,
        logger: DistributedLogger | None = None,
        interval: int = 1,
        priority: int = 10,
        log_eval: bool = True,
        report_cpu: bool = False,
    ) -> None:
        super().__init__(logger=logger, interval=interval, priority=priority)
        self._log_eval = log_eval
        self._report_cpu = report_cpu

    def _report(self, trainer: Trainer, prefix: str) -> None:
        if self._is_epoch_to_log(trainer) and is_rank_to_log(need_last_stage=False):
            self.logger.info(memory_usage_message(prefix, self._report_cpu))

    def before_train(self, trainer: Trainer) -> None:
        """Log before the first epoch."""
        self._report(trainer, "Before-train")

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log after a training epoch."""
        self._report(trainer, f"[Epoch {trainer.cur_epoch} / Train]")

    def after_test(self, trainer: Trainer) -> None:
        """Log after an evaluation (with ``log_eval``)."""
        if self._log_eval:
            self._report(trainer, f"[Epoch {trainer.cur_epoch} / Test]")
