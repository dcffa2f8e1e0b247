"""Background file writing for ``use_async=True`` saves.

An asynchronous save does its collective part (gathering the full state) at once and keeps the
writer's part as host copies (:func:`host_copy`); an :class:`AsyncWriter` then writes the files
on one background thread, in the order saves were made, with the same crash-safe writes as a
synchronous save (a staging directory renamed into place): a process that dies mid-write leaves
the previous checkpoint untouched. No collective runs on the background thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kolossos.checkpoint_io.errors import CheckpointError

__all__ = ["AsyncWriter", "host_copy"]


def host_copy(obj: Any) -> Any:
    """A copy of every tensor of a nested structure in host memory (so training may change the
    originals while the copy is written); other values are shared."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: host_copy(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [host_copy(value) for value in obj]
    if isinstance(obj, tuple):
        return tuple(host_copy(value) for value in obj)
    return obj


class AsyncWriter:
    """Writes submitted jobs on one background thread, in order; errors surface in :meth:`wait`.

    Example:
        >>> writer = AsyncWriter()
        >>> writer.submit(lambda: path.write_text("x"), path)
        >>> writer.wait()  # raises CheckpointError if the write failed
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[tuple[str, Future[None]]] = []
        self.used = False
        """Whether anything was ever submitted (loads then settle pending writes first)."""

    def submit(self, write: Callable[[], None], path: str | os.PathLike[str]) -> None:
        """Queue ``write`` (which writes ``path``) behind the jobs already queued."""
        if self._pool is None:  # non-daemon: the interpreter finishes the writes before exiting
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kolossos-ckpt")
        self._jobs.append((str(path), self._pool.submit(write)))
        self.used = True

    def pending(self) -> bool:
        """Whether a queued write has not finished yet (never blocks)."""
        return any(not job.done() for _, job in self._jobs)

    def wait(self) -> None:
        """Block until every queued write finished; forget them.

        Raises:
            CheckpointError: the first write that failed (the path and the error named); the
                others were still waited for.
        """
        jobs, self._jobs = self._jobs, []
        failed: tuple[str, BaseException] | None = None
        for path, job in jobs:
            error = job.exception()
            if error is not None and failed is None:
                failed = (path, error)
        if failed is not None:
            path, error = failed
            raise CheckpointError(
                f"writing {path!r} in the background failed: {type(error).__name__}: {error}. "
                "The previous checkpoint there, if any, is unchanged."
            ) from error
