"""``SaveCheckpointHook``: saves model, optimizer and LR scheduler every few epochs or
iterations with :func:`kolossos.legacy.utils.save_checkpoint`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from kolossos.legacy.registry import HOOKS
from kolossos.legacy.trainer.hooks.base_hook import BaseHook
from kolossos.legacy.trainer.hooks.lr_scheduler_hook import LRSchedulerHook
from kolossos.legacy.utils.checkpoint import save_checkpoint
from kolossos.logging import get_dist_logger

if TYPE_CHECKING:
    from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["SaveCheckpointHook"]

_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


@HOOKS.register_module
class SaveCheckpointHook(BaseHook):
    """Saves a checkpoint after every ``interval``-th training epoch (or iteration, with
    ``save_by_iter``): the epoch index, the model, the engine's optimizer and the scheduler of
    the trainer's :class:`LRSchedulerHook` (if any). Load it with
    ``kolossos.legacy.utils.load_checkpoint(file, model, optimizer, lr_scheduler)``, which
    returns the saved epoch index. Every rank must run the hook (rank 0 writes).

    ``checkpoint_dir`` is a file when it ends in ``.pt``, ``.pth``, ``.bin``, ``.ckpt`` or
    ``.tar`` (overwritten by each save, as upstream), otherwise a directory holding
    ``epoch<E>.pt`` (``step<S>.pt`` with ``save_by_iter``) per save.

    Differences from Colossal-AI: saves come after the ``interval``-th, ``2·interval``-th ...
    epoch (upstream saves after epoch indexes 0, ``interval``, ...), and ``save_by_iter`` saves
    by iteration only (upstream also saves by epoch with the same interval).

    Args:
        interval: epochs (iterations with ``save_by_iter``) between saves.
        checkpoint_dir: the checkpoint file or directory (see above).
        model: the model to save (default: the engine's model).
        save_by_iter: count iterations instead of epochs.
        priority: the place among the trainer's hooks (default 10: after the LR scheduler).

    Raises:
        ValueError: ``interval`` is not a positive integer, or ``checkpoint_dir`` is missing.
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> hooks = [SaveCheckpointHook(interval=1, checkpoint_dir="./ckpt")]
        >>> hooks = [SaveCheckpointHook(1, "xxx.pt", model)]
    """

    def __init__(
        self,
        interval: int = 1,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        model: nn.Module | None = None,
        save_by_iter: bool = False,
        priority: int = 10,
    ) -> None:
        super().__init__(priority=priority)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"SaveCheckpointHook(interval={interval!r}): the interval must be an integer "
                ">= 1 (save every interval-th epoch); use interval=1 to save every epoch."
            )
        if checkpoint_dir is None or os.fspath(checkpoint_dir) == "":
            raise ValueError(
                "SaveCheckpointHook needs checkpoint_dir: a directory (e.g. './ckpt') or a file "
                "ending in .pt (e.g. 'xxx.pt')."
            )
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"SaveCheckpointHook(model={type(model).__name__}): pass an nn.Module, or leave "
                "model out to save the engine's model."
            )
        self.interval = interval
        self.checkpoint_dir = checkpoint_dir
        self.model = model
        self.save_by_iter = save_by_iter
        self.logger = get_dist_logger()
        self._lr_scheduler: Any = None
        self.saved_files: list[Path] = []

    def checkpoint_path(self, epoch: int, step: int) -> Path:
        """The file a save at ``epoch`` (or ``step`` with ``save_by_iter``) writes."""
        target = Path(self.checkpoint_dir)  # not None: checked in __init__
        if target.suffix.lower() in _FILE_SUFFIXES and not target.is_dir():
            return target
        return target / (f"step{step}.pt" if self.save_by_iter else f"epoch{epoch}.pt")

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Find the trainer's LR scheduler and default the model to the engine's."""
        self._lr_scheduler = None
        for hook in trainer.hooks:
            if isinstance(hook, LRSchedulerHook):
                self._lr_scheduler = hook.lr_scheduler
                break
        if self.model is None:
            self.model = trainer.engine.model

    def _save(self, trainer: Trainer, what: str, step: int) -> None:
        path = self.checkpoint_path(trainer.cur_epoch, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        assert self.model is not None  # set in after_hook_is_attached
        save_checkpoint(  # COLLECTIVE: rank 0 writes, every rank waits
            path, trainer.cur_epoch, self.model, trainer.engine.optimizer, self._lr_scheduler
        )
        self.saved_files.append(path)
        self.logger.info(f"checkpoint for {what} is saved to {path}", ranks=[0])

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Save after every ``interval``-th iteration (with ``save_by_iter``)."""
        step = trainer.cur_step + 1  # iterations done, this one included
        if self.save_by_iter and step % self.interval == 0:
            self._save(trainer, f"iteration {step}", step)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Save after every ``interval``-th epoch (without ``save_by_iter``)."""
        if not self.save_by_iter and (trainer.cur_epoch + 1) % self.interval == 0:
            self._save(trainer, f"epoch {trainer.cur_epoch}", trainer.cur_step)
