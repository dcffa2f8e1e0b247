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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kolossos.trainer.paths import STATE_FILE, RunPaths, checkpoint_name, complete_checkpoints

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
    """Restore states captured by :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "accelerator" in state:
        from kolossos.accelerator import get_accelerator

        get_accelerator().set_rng_state(state["accelerator"])


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Checkpointer:
    """Saves and restores the training state of one run on every rank.

    Every method is collective: all ranks call it at the same point.

    Args:
        booster: the Booster that boosted ``model`` and ``optimizer``.
        model, optimizer, lr_scheduler: the boosted objects.
        paths: the run's folders.
        keep_last: complete checkpoints to keep.
    """

    def __init__(
        self,
        booster: Any,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        paths: RunPaths,
        keep_last: int,
    ) -> None:
        self.booster = booster
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.paths = paths
        self.keep_last = keep_last
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    @staticmethod
    def _barrier() -> None:
        if dist.is_initialized():
            dist.barrier()  # SYNC POINT

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write the checkpoint after ``step`` steps; return its final folder.

        Args:
            step: optimizer steps done.
            state: JSON-ready trainer state stored in :data:`STATE_FILE` (``step`` is added).
        """
        final = self.paths.checkpoints / checkpoint_name(step)
        partial = final.with_name(f".{final.name}{_PARTIAL}")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            (partial / "rng").mkdir(parents=True)
        self._barrier()  # the folder exists before anyone writes into it
        self.booster.save_model(
            self.model, str(partial / "model"), shard=True, use_safetensors=_has_safetensors()
        )
        self.booster.save_optimizer(self.optimizer, str(partial / "optimizer"), shard=True)
        if self.lr_scheduler is not None:
            self.booster.save_lr_scheduler(self.lr_scheduler, str(partial / "lr_scheduler.bin"))
        rng_file = partial / "rng" / f"rank_{self.rank:05d}.pt"
        tmp = rng_file.with_suffix(".tmp")
        torch.save(capture_rng(), tmp)
        os.replace(tmp, rng_file)
        self._barrier()  # every rank's part is on disk
        if self.rank == 0:
            body = json.dumps({**state, "step": step}, indent=2, sort_keys=True)
            with open(partial / STATE_FILE, "w", encoding="utf-8") as fh:
                fh.write(body + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            if final.exists():  # an older attempt at the same step
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(final.parent)
            self._prune()
        return final

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

        A checkpoint saved by fewer processes has no RNG state for the extra ranks: theirs stay
        as seeded (only dropout could differ from an uninterrupted run).
        """
        self.booster.load_model(self.model, str(folder / "model"))
        self.booster.load_optimizer(self.optimizer, str(folder / "optimizer"))
        if self.lr_scheduler is not None:
            self.booster.load_lr_scheduler(self.lr_scheduler, str(folder / "lr_scheduler.bin"))
        rng_file = folder / "rng" / f"rank_{self.rank:05d}.pt"
        if rng_file.is_file():
            restore_rng(torch.load(rng_file, weights_only=True))
        return self.paths.read_state(folder)


def _has_safetensors() -> bool:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return False
    return True
