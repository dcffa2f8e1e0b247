"""Periodic checkpoints through the Booster, the last K kept, and exact resumption.

A checkpoint folder ``checkpoints/step_NNNNNN/`` holds::

    model/              booster.save_model(shard=True, safetensors): Hugging Face layout
    optimizer/          booster.save_optimizer(shard=True): name-keyed optimizer state
    lr_scheduler.bin    booster.save_lr_scheduler
    rng/rank_NNNNN.pt   every rank's RNG states (torch, python, numpy, accelerator)
    trainer_state.json  step, tokens, elapsed time, config; written last

It is written under the hidden name ``.step_NNNNNN.partial`` and renamed once every rank has
finished, so a crash or Ctrl-C at any moment leaves the previous checkpoints intact and never
leaves a complete-looking partial one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kolossos.checkpoint_io import CheckpointError
from kolossos.train.checkpoint_files import agree_on_error, read_rng_file, rng_state_problem
from kolossos.train.paths import STATE_FILE, RunPaths, checkpoint_name, complete_checkpoints
from kolossos.train.state_files import CheckpointFileError

__all__ = ["Checkpointer", "capture_rng", "restore_rng"]

_PARTIAL = ".partial"


def capture_rng() -> dict[str, Any]:
    """This process's RNG states in a form ``torch.load(weights_only=True)`` reads back."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        keys_t = torch.from_numpy(np.asarray(keys).astype("int64"))
        state["numpy"] = (kind, keys_t, pos, has_gauss, cached)
    from kolossos.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.name != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`capture_rng`, after checking all of them.

    A numpy state is skipped without numpy, an accelerator state on a CPU-only process.

    Raises:
        ValueError: ``state`` is not what :func:`capture_rng` returns (nothing was restored);
            a checkpoint's file is read and checked by
            :func:`~kolossos.train.checkpoint_files.read_rng_file`.
    """
    problem = rng_state_problem(state)
    if problem is not None:
        raise ValueError(f"{problem}; restore_rng takes what capture_rng returned.")
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        with contextlib.suppress(ImportError):  # no numpy here: no numpy generator to restore
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "accelerator" in state:
        from kolossos.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.name != "cpu":  # saved on a device this process does not have
            accelerator.set_rng_state(state["accelerator"])


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class _Pending:
    """A checkpoint whose files are still being written in the background."""

    step: int
    state: dict[str, Any]
    partial: Path
    final: Path


class Checkpointer:
    """Saves and restores the training state of one run on every rank.

    Every method is collective: all ranks call it at the same point.

    With ``asynchronous`` (``checkpoint.async``), :meth:`save` returns once the model and
    optimizer states are in host memory; their files are written in the background.
    :meth:`poll` (after every step) completes the checkpoint once every rank's files are on
    disk, :meth:`flush` waits for that (before the next save, a load, and at the end).

    Args:
        booster: the Booster that boosted ``model`` and ``optimizer``.
        model, optimizer, lr_scheduler: the boosted objects.
        paths: the run's folders.
        keep_last: complete checkpoints to keep.
        asynchronous: write model and optimizer files in the background.
    """

    def __init__(
        self,
        booster: Any,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        paths: RunPaths,
        keep_last: int,
        asynchronous: bool = False,
    ) -> None:
        self.booster = booster
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.paths = paths
        self.keep_last = keep_last
        self.asynchronous = asynchronous
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pending: _Pending | None = None

    @staticmethod
    def _barrier() -> None:
        if dist.is_initialized():
            dist.barrier()  # SYNC POINT

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Write the checkpoint after ``step`` steps; return its final folder, or ``None`` when
        its files are still being written (asynchronous: see :meth:`poll`).

        Args:
            step: optimizer steps done.
            state: JSON-ready trainer state stored in :data:`STATE_FILE` (``step`` is added).
        """
        self.flush()  # one checkpoint in flight at a time
        final = self.paths.checkpoints / checkpoint_name(step)
        pending = _Pending(step, state, final.with_name(f".{final.name}{_PARTIAL}"), final)
        with self._cleanup(pending):
            self._write(pending)
        if self.asynchronous:
            self._pending = pending
            return None
        self._barrier()  # every rank's part is on disk
        return self._complete(pending)

    def poll(self) -> Path | None:
        """Complete the checkpoint in flight if every rank has written its files; return its
        folder then (``None`` otherwise; one small all-reduce while one is in flight)."""
        if self._pending is None:
            return None
        from kolossos.cluster.collectives import comm_device

        busy = torch.tensor([float(self.booster.async_saves_pending())], device=comm_device())
        if dist.is_initialized():
            dist.all_reduce(busy)  # SYNC POINT
        return None if busy.item() > 0 else self.flush()

    def flush(self) -> Path | None:
        """Wait for the checkpoint in flight and complete it; return its folder (``None`` when
        none was in flight).

        Raises:
            CheckpointError: a rank's background write failed (on every rank; the checkpoint
                is discarded and the previous ones are kept).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        with self._cleanup(pending):
            error: CheckpointError | None = None
            try:
                self.booster.wait_async_saves()
            except CheckpointError as exc:
                error = CheckpointError(f"step {pending.step}, rank {self.rank}: {exc}")
            agree_on_error(error)  # SYNC POINT: every rank's files are on disk, or all raise
            return self._complete(pending)

    @contextlib.contextmanager
    def _cleanup(self, pending: _Pending) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if self.rank == 0:  # what was half-written goes (the older checkpoints stay)
                shutil.rmtree(pending.partial, ignore_errors=True)
            raise

    def _write(self, p: _Pending) -> None:
        if self.rank == 0:
            shutil.rmtree(p.partial, ignore_errors=True)
            (p.partial / "rng").mkdir(parents=True)
        self._barrier()  # the folder exists before anyone writes into it
        self.booster.save_model(
            self.model,
            str(p.partial / "model"),
            shard=True,
            use_safetensors=_has_safetensors(),
            use_async=self.asynchronous,
        )
        self.booster.save_optimizer(
            self.optimizer, str(p.partial / "optimizer"), shard=True, use_async=self.asynchronous
        )
        if self.lr_scheduler is not None:
            self.booster.save_lr_scheduler(self.lr_scheduler, str(p.partial / "lr_scheduler.bin"))
        rng_file = p.partial / "rng" / f"rank_{self.rank:05d}.pt"
        tmp = rng_file.with_suffix(".tmp")
        torch.save(capture_rng(), tmp)
        os.replace(tmp, rng_file)

    def _complete(self, p: _Pending) -> Path:
        """Rank 0 marks the checkpoint complete (state file last, then the rename) and prunes."""
        if self.rank == 0:
            body = json.dumps({**p.state, "step": p.step}, indent=2, sort_keys=True)
            with open(p.partial / STATE_FILE, "w", encoding="utf-8") as fh:
                fh.write(body + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            if p.final.exists():  # an older attempt at the same step
                shutil.rmtree(p.final)
            os.replace(p.partial, p.final)
            _fsync_dir(p.final.parent)
            self._prune()
        return p.final

    def _prune(self) -> None:
        """Delete all but the newest ``keep_last`` complete checkpoints, and stale partials."""
        for _, path in complete_checkpoints(self.paths.checkpoints)[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for entry in self.paths.checkpoints.iterdir():
            if entry.name.startswith(".") and entry.name.endswith(_PARTIAL):
                shutil.rmtree(entry, ignore_errors=True)

    def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint as rank 0 sees it (the same answer on every rank)."""
        found: list[Any] = [self.paths.latest_checkpoint() if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)  # SYNC POINT
        return found[0]

    def load(self, folder: Path) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and this rank's RNG from ``folder``; return the
        trainer state.

        The trainer's own files come first, read safely and checked on every rank before any
        collective: the trainer state, this rank's RNG state and the LR scheduler (loaded then:
        it touches nothing else). The ranks then agree, so a bad file stops all of them with the
        same error before the model and optimizer are loaded.

        A checkpoint saved by fewer processes has no RNG state for the extra ranks: theirs stay
        as seeded (only dropout could differ from an uninterrupted run).

        Raises:
            CheckpointFileError: a trainer file or the scheduler file is missing, damaged or of
                another structure (named, on every rank).
            CheckpointError: the model or optimizer files cannot be loaded.
        """
        error: CheckpointFileError | None = None
        state: dict[str, Any] = {}
        rng: dict[str, Any] | None = None
        try:
            state = self.paths.read_state(folder)
            rng_file = folder / "rng" / f"rank_{self.rank:05d}.pt"
            rng = read_rng_file(rng_file, self.rank) if rng_file.is_file() else None
            if self.lr_scheduler is not None:
                lr_file = folder / "lr_scheduler.bin"
                try:
                    self.booster.load_lr_scheduler(self.lr_scheduler, str(lr_file))
                except CheckpointError as exc:
                    raise CheckpointFileError(lr_file, str(exc)) from exc
        except CheckpointFileError as exc:
            error = exc
        agree_on_error(error)  # SYNC POINT: all ranks' files are fine, or all ranks raise
        self.booster.load_model(self.model, str(folder / "model"))
        self.booster.load_optimizer(self.optimizer, str(folder / "optimizer"))
        if rng is not None:
            restore_rng(rng)
        return state


def _has_safetensors() -> bool:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return False
    return True
