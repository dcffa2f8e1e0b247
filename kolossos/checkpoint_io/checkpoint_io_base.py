"""``CheckpointIO``: the shared save/load logic; plugins override only what each rank contributes.

The public methods (what ``Booster.save_model`` and friends call) own everything that must be the
same for every plugin: the file formats, shard planning and the index, crash-safe writes,
validation against the target and error messages. What differs between plugins is how the *full*
state is produced and consumed, and that is a small set of hooks:

============================  ===============================================================
hook                          contract
============================  ===============================================================
``model_state_items``         yield ``(name, full tensor)`` in state-dict order; every rank
                              calls it (so it may gather), only the writer's output is written
``model_layout``              names and global shapes the model expects (+ tied names)
``load_model_piece``          put a piece of the full state (``name -> full tensor``) into the
                              model, cutting out this rank's slice if it is sharded
``optimizer_param_names``     the name of each optimizer parameter, group by group
``optimizer_param_shapes``    global shape of each parameter, by name
``optimizer_param_groups``    the param groups with names instead of parameters
``optimizer_state_items``     yield ``(name, full state)`` per parameter; every rank calls it
``load_optimizer_state``      load ``(name, full state)`` pairs, re-sliced for this rank
``is_writer``                 whether this rank writes files (default: rank 0 of the group)
============================  ===============================================================

Peak memory stays near one shard: states are produced lazily, planned into shards as they come,
and each shard is written and released before the next is gathered; loads go file by file.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.checkpoint_io import model_io, optimizer_io
from kolossos.checkpoint_io._common import check_save_args
from kolossos.checkpoint_io.backends import read_object_file, write_object_file
from kolossos.checkpoint_io.errors import CheckpointError, LoadReport
from kolossos.checkpoint_io.optim_format import named_param_groups
from kolossos.checkpoint_io.param_names import unwrap_optimizer
from kolossos.checkpoint_io.state_check import ModelLayout

__all__ = ["CheckpointIO"]

OptimizerLike = Any  # torch.optim.Optimizer or kolossos.interface.OptimizerWrapper


class CheckpointIO(ABC):
    """Saves and loads models, optimizers and LR schedulers in portable formats.

    Model checkpoints use Hugging Face's file layouts; optimizer checkpoints use the name-keyed
    format of :mod:`kolossos.checkpoint_io.optim_format`. Both load on any number of processes and
    any plugin. Subclasses implement the hooks listed in the module docstring.

    Args:
        process_group: the group whose ranks take part in saving (default: the world).

    Example:
        >>> io = GeneralCheckpointIO()
        >>> io.save_model(model, "ckpt/model", shard=True, size_per_shard=512)
        >>> io.load_model(fresh_model, "ckpt/model")
    """

    def __init__(self, process_group: Any | None = None) -> None:
        self.process_group = process_group

    # ------------------------------------------------------------------ ranks
    def _distributed(self) -> bool:
        return (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def is_writer(self) -> bool:
        """Whether this rank writes the files (rank 0 of the group; always true in one process)."""
        return not self._distributed() or dist.get_rank(self.process_group) == 0

    def run_collective_write(self, write: Callable[[], None], path: Any) -> None:
        """Run ``write`` on every rank between two synchronisation points.

        The first (a barrier) makes sure no rank still reads the old checkpoint; the second
        gathers every rank's outcome, so all ranks return only once the files are complete, and
        all raise if any rank failed (no rank waits forever for a writer that died of an error).
        """
        if not self._distributed():
            write()
            return
        dist.barrier(group=self.process_group)  # sync point: nobody is reading `path` any more
        error: Exception | None = None
        try:
            write()
        except Exception as exc:
            error = exc
        outcomes: list[Any] = [None] * dist.get_world_size(self.process_group)
        message = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(outcomes, message, group=self.process_group)  # sync point
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(outcomes) if m is not None]
        if failed:
            rank, msg = failed[0]
            raise CheckpointError(f"saving {str(path)!r} failed on rank {rank}: {msg}")

    # ------------------------------------------------------------------ hooks: model
    @abstractmethod
    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the model's full state as ``(name, tensor)``; called on every rank."""

    @abstractmethod
    def model_layout(self, model: nn.Module) -> ModelLayout:
        """The names and global shapes ``model`` expects to load."""

    @abstractmethod
    def load_model_piece(self, model: nn.Module, piece: dict[str, torch.Tensor]) -> None:
        """Copy a piece of the full state (validated names and shapes) into ``model``."""

    # ------------------------------------------------------------------ hooks: optimizer
    @abstractmethod
    def optimizer_param_names(self, optimizer: OptimizerLike) -> list[list[str]]:
        """The name of each parameter of ``optimizer``, group by group."""

    @abstractmethod
    def optimizer_param_shapes(
        self, optimizer: OptimizerLike, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """The global shape of each parameter, by name."""

    def optimizer_param_groups(
        self, optimizer: OptimizerLike, names: list[list[str]]
    ) -> list[dict[str, Any]]:
        """The param groups' hyper-parameters, with ``params`` as lists of names (those of the
        innermost torch optimizer, whose groups every wrapper here keeps in the user's order)."""
        return named_param_groups(unwrap_optimizer(optimizer), names)

    @abstractmethod
    def optimizer_state_items(
        self, optimizer: OptimizerLike, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield ``(name, full state)`` per parameter that has state; called on every rank."""

    @abstractmethod
    def load_optimizer_state(
        self,
        optimizer: OptimizerLike,
        names: list[list[str]],
        header: dict[str, Any],
        states: Iterator[tuple[str, dict[str, Any]]],
        mapping: dict[str, str],
    ) -> None:
        """Load full states (``mapping``: checkpoint name -> target name) into ``optimizer``."""

    # ------------------------------------------------------------------ public API
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = 1024,
        use_safetensors: bool = False,
    ) -> None:
        """Save ``model``'s state: one file, or (``shard=True``) a directory of shards + index.

        See :func:`kolossos.checkpoint_io.model_io.save_model` for the layouts.
        """
        model_io.save_model(
            self, model, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_safetensors
        )

    def load_model(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], strict: bool = True
    ) -> LoadReport:
        """Load a model checkpoint of any supported layout (detected) into ``model``.

        See :func:`kolossos.checkpoint_io.model_io.load_model`.
        """
        return model_io.load_model(self, model, checkpoint, strict)

    def save_optimizer(
        self,
        optimizer: OptimizerLike,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = 1024,
    ) -> None:
        """Save ``optimizer``'s state, keyed by parameter name, as one file or a directory.

        See :func:`kolossos.checkpoint_io.optimizer_io.save_optimizer`.
        """
        optimizer_io.save_optimizer(
            self, optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard
        )

    def load_optimizer(
        self, optimizer: OptimizerLike, checkpoint: str | os.PathLike[str]
    ) -> LoadReport:
        """Load an optimizer checkpoint (any layout, any saving world size) into ``optimizer``.

        See :func:`kolossos.checkpoint_io.optimizer_io.load_optimizer`.
        """
        return optimizer_io.load_optimizer(self, optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Save ``lr_scheduler.state_dict()`` to the file ``checkpoint`` (the writer rank only)."""
        check_save_args(checkpoint, 1, None)
        if Path(checkpoint).is_dir():
            raise IsADirectoryError(
                f"checkpoint={str(checkpoint)!r} is a directory; an LR scheduler is saved to a "
                "file, e.g. 'ckpt/lr_scheduler.bin'."
            )
        state = lr_scheduler.state_dict()

        def write() -> None:
            if self.is_writer():
                write_object_file(state, checkpoint)

        self.run_collective_write(write, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Load an LR scheduler state saved by :meth:`save_lr_scheduler`."""
        state = read_object_file(checkpoint)
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{str(checkpoint)!r} is not an LR scheduler checkpoint "
                f"(found {type(state).__name__})"
            )
        lr_scheduler.load_state_dict(state)
