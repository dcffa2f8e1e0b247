"""``TensorboardHook``: writes the trainer's metrics to TensorBoard event files."""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from kolossos.legacy.context.parallel_context import global_context as gpc
from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.registry import HOOKS
from kolossos.legacy.trainer.hooks.base_hook import BaseHook

if TYPE_CHECKING:
    from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["TensorboardHook"]


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch's module imports the tensorboard package
        raise ImportError(
            "TensorboardHook needs the TensorBoard package, which is not installed: "
            "pip install tensorboard"
        ) from err
    return SummaryWriter


@HOOKS.register_module
class TensorboardHook(BaseHook):
    """Writes each metric of ``trainer.states["metrics"]`` as a scalar ``<name>/<train|test>``
    at ``trainer.cur_step``: per-step metrics after every iteration, epoch metrics after every
    epoch. Files go to ``<log_dir>/<parallel_mode>_rank_<r>/`` on the chosen ranks.

    Reading a metric is COLLECTIVE over the DATA group, so every rank reads; only the chosen
    ranks write.

    Args:
        log_dir: the directory of the event files (created).
        ranks: the ranks (in ``parallel_mode``) that write; ``None``: all of them.
        parallel_mode: the group ``ranks`` refer to (default: all processes).
        priority: the place among the trainer's hooks (default 10: after the metric hooks).

    Raises:
        ImportError: TensorBoard is not installed (``pip install tensorboard``).
        ValueError: a writing rank is not on the last pipeline stage.

    Example:
        >>> hooks = [LossHook(), TensorboardHook(log_dir="./tb_logs", ranks=[0])]
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        ranks: Sequence[int] | None = None,
        parallel_mode: Hashable = ParallelMode.GLOBAL,
        priority: int = 10,
    ) -> None:
        super().__init__(priority=priority)
        writer_class = _summary_writer_class()  # on every rank: the same error everywhere
        initialized = gpc.is_initialized(parallel_mode)
        rank = gpc.get_local_rank(parallel_mode) if initialized else 0
        self._is_valid_rank_to_log = ranks is None or rank in ranks or not initialized
        if (
            self._is_valid_rank_to_log
            and gpc.is_initialized(ParallelMode.PIPELINE)
            and not gpc.is_last_rank(ParallelMode.PIPELINE)
        ):
            raise ValueError(
                "TensorboardHook can only write on the last pipeline stage (where the loss is); "
                "choose ranks of that stage with ranks=[...]."
            )
        self.writer: Any = None
        if self._is_valid_rank_to_log:
            path = os.path.join(os.fspath(log_dir), f"{parallel_mode}_rank_{rank}")
            os.makedirs(path, exist_ok=True)
            self.writer = writer_class(log_dir=path, filename_suffix=f"_rank_{rank}")

    def _metrics(self, trainer: Trainer, mode: str) -> dict[str, Any]:
        metrics: dict[str, dict[str, Any]] = trainer.states.get("metrics", {})
        return metrics.get(mode, {})

    def _log(self, trainer: Trainer, mode: str, epoch_metrics: bool) -> None:
        for name, metric in self._metrics(trainer, mode).items():
            if metric.epoch_only != epoch_metrics:
                continue
            value = (
                metric.get_accumulated_value() if epoch_metrics else metric.get_last_step_value()
            )
            if self.writer is not None:
                self.writer.add_scalar(f"{name}/{mode}", float(value), trainer.cur_step)

    def _flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Write the per-step train metrics."""
        self._log(trainer, "train", epoch_metrics=False)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Write the epoch train metrics."""
        self._log(trainer, "train", epoch_metrics=True)
        self._flush()

    def after_test_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Write the per-step test metrics."""
        self._log(trainer, "test", epoch_metrics=False)

    def after_test_epoch(self, trainer: Trainer) -> None:
        """Write the epoch test metrics."""
        self._log(trainer, "test", epoch_metrics=True)
        self._flush()

    def after_train(self, trainer: Trainer) -> None:
        """Flush the event files."""
        self._flush()
