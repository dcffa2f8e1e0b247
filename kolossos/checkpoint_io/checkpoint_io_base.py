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
from kolossos.checkpoint_io._common import check_save_args, drain
from kolossos.checkpoint_io.async_writer import AsyncWriter, host_copy
from kolossos.checkpoint_io.backends import read_object_file, write_object_file
from kolossos.checkpoint_io.errors import CheckpointError, LoadReport
from kolossos.checkpoint_io.optim_format import named_param_groups
from kolossos.checkpoint_io.param_names import unwrap_optimizer
from kolossos.checkpoint_io.read_plan import ReadPlan
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
        self.async_writer = AsyncWriter()
        """Writes ``use_async=True`` saves in the background (a Booster shares one writer
        between the checkpoint IOs it hands out)."""

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

    def collective_save(
        self,
        produce: Callable[[], Iterator[Any]],
        write: Callable[[Iterator[Any]], None],
        path: Any,
        use_async: bool = False,
    ) -> None:
        """Save through :meth:`run_collective_write`: every rank runs ``produce()`` to its end
        (it may gather), and the writer passes the items to ``write``.

        With ``use_async`` the writer keeps host copies of the items (:func:`host_copy`) and
        :attr:`async_writer` writes them in the background: the call returns once the state is
        in host memory. Without it, items are written as they come (one shard in memory).
        """
        snapshot: list[Any] = []

        def run() -> None:
            items = produce()
            try:
                if self.is_writer():
                    if use_async:
                        snapshot.extend(host_copy(item) for item in items)
                    else:
                        write(items)
            finally:
                drain(items)

        self.run_collective_write(run, path)
        if use_async:
            self.async_writer.used = True  # on every rank: loads settle together
            if self.is_writer():
                self.async_writer.submit(lambda: write(iter(snapshot)), path)

    def wait_async(self) -> None:
        """Wait for this rank's background writes (local: no collective).

        Raises:
            CheckpointError: a background write failed (named).
        """
        self.async_writer.wait()

    def _settle_async(self) -> None:
        """Before a load: every rank's background writes are on disk (waits, then a barrier;
        all ranks call loads together, and all saved with the same ``use_async``)."""
        if not self.async_writer.used:
            return
        self.async_writer.wait()
        if self._distributed():
            dist.barrier(group=self.process_group)  # SYNC POINT: every writer finished

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
        """Copy a piece of the full state (validated names and shapes) into ``model``; an
        entry :meth:`model_read_plan` selected arrives as the selected part."""

    def model_read_plan(self, model: nn.Module) -> ReadPlan:
        """What this rank reads of each stored tensor when loading ``model`` (see
        :mod:`~kolossos.checkpoint_io.read_plan`); the default, ``{}``, reads everything whole.
        Sharded engines override it so that a rank reads about its own shard only."""
        return {}

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
        use_async: bool = False,
    ) -> None:
        """Save ``model``'s state: one file, or (``shard=True``) a directory of shards + index.

        See :func:`kolossos.checkpoint_io.model_io.save_model` for the layouts. With
        ``use_async`` the files are written in the background (see :meth:`collective_save`);
        :meth:`wait_async` waits for them.
        """
        model_io.save_model(
            self,
            model,
            checkpoint,
            shard,
            gather_dtensor,
            prefix,
            size_per_shard,
            use_safetensors,
            use_async,
        )

    def load_model(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], strict: bool = True
    ) -> LoadReport:
        """Load a model checkpoint of any supported layout (detected) into ``model``.

        See :func:`kolossos.checkpoint_io.model_io.load_model`.
        """
        self._settle_async()
        return model_io.load_model(self, model, checkpoint, strict)

    def save_optimizer(
        self,
        optimizer: OptimizerLike,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = 1024,
        use_async: bool = False,
    ) -> None:
        """Save ``optimizer``'s state, keyed by parameter name, as one file or a directory.

        See :func:`kolossos.checkpoint_io.optimizer_io.save_optimizer`; ``use_async`` as in
        :meth:`save_model`.
        """
        optimizer_io.save_optimizer(
            self, optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
        )

    def load_optimizer(
        self, optimizer: OptimizerLike, checkpoint: str | os.PathLike[str]
    ) -> LoadReport:
        """Load an optimizer checkpoint (any layout, any saving world size) into ``optimizer``.

        See :func:`kolossos.checkpoint_io.optimizer_io.load_optimizer`.
        """
        self._settle_async()
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
        """Load an LR scheduler state saved by :meth:`save_lr_scheduler`.

        The file is read safely and checked against ``lr_scheduler.state_dict()`` before
        anything is loaded: it must hold every key of that state (except the bookkeeping keys
        torch releases add or drop), values of the same kinds (numbers, lists, strings...), and
        one entry per param group in the per-group lists (``base_lrs``, ``lr_lambdas``...).

        Raises:
            CheckpointNotFoundError: the file does not exist.
            CheckpointError: the file is corrupt, pickles Python objects, or does not hold a
                state of this scheduler (the message names the file and what differs).
        """
        self._settle_async()
        state = read_object_file(checkpoint)
        problem = _scheduler_state_problem(state, lr_scheduler)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint file {str(checkpoint)!r} is not a state of this LR scheduler: "
                f"{problem}. Load the file booster.save_lr_scheduler wrote for the same scheduler "
                "class over the same param groups; nothing was loaded."
            )
        lr_scheduler.load_state_dict(state)


#: bookkeeping keys some torch releases have and others not: neither required nor refused
_VERSION_DEPENDENT_KEYS = frozenset({"verbose", "_is_initial", "_get_lr_called_within_step"})
#: scheduler state entries holding one value per optimizer param group
_PER_GROUP_KEYS = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs")
#: learning rates per group: numbers (or tensors, for tensor learning rates)
_LR_LISTS = ("base_lrs", "_last_lr")
#: entries every torch scheduler relies on: never ``None`` when the scheduler has a value
_CORE_KEYS = frozenset({"last_epoch", "_step_count", *_LR_LISTS})


def _kind(value: Any) -> str | None:
    """The kind of a state value compared on load (``None``: not compared)."""
    if isinstance(value, bool):
        return "bool"
    for kind, types in (("number", (int, float)), ("str", str), ("list", (list, tuple))):
        if isinstance(value, types):
            return kind
    if isinstance(value, dict):
        return "dict"
    return "tensor" if isinstance(value, torch.Tensor) else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _scheduler_state_problem(state: Any, lr_scheduler: Any) -> str | None:
    """What makes ``state`` unfit for ``lr_scheduler.load_state_dict`` (``None``: nothing).

    Compares ``state`` with ``lr_scheduler.state_dict()``: missing keys, values of another kind
    (a number where the scheduler has a number, and so on) and per-group lists of another length.
    """
    name = type(lr_scheduler).__name__
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        return f"it holds a {type(state).__name__}, not a state dict with string keys"
    expected: dict[str, Any] = lr_scheduler.state_dict()
    missing = sorted(set(expected) - set(state) - _VERSION_DEPENDENT_KEYS)
    if missing:
        return (
            f"an LR scheduler state for {name} must have keys {sorted(expected)}; the file has "
            f"{sorted(state)} (missing {missing})"
        )
    for key, want in expected.items():
        if key not in state or _kind(want) is None:
            continue
        got = state[key]
        if _kind(got) != _kind(want) and (got is not None or key in _CORE_KEYS):
            return (
                f"{key!r} must be a {_kind(want)} for {name} (like {_short(want)}), found a "
                f"{type(got).__name__}: {_short(got)}"
            )
        if key in _PER_GROUP_KEYS and got is not None and len(got) != len(want):
            return (
                f"{key!r} has {len(got)} entries, one per param group of the optimizer it was "
                f"saved with, but this {name}'s optimizer has {len(want)} param groups"
            )
        if key in _LR_LISTS and not all(_kind(v) in ("number", "tensor") for v in got):
            return f"{key!r} must hold one learning rate (a number) per group, found {_short(got)}"
    return None
