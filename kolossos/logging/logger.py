"""A rank-aware logger: ``logger.info(msg, ranks=[0])`` logs on the listed ranks only."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist

_FORMAT = "%(asctime)s %(levelname)s %(name)s [rank %(rank)s] %(message)s"
_DATE = "%Y-%m-%d %H:%M:%S"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _current_rank()
        return True


def _check_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    name = level.upper()
    if name not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(_LEVELS)}.")
    return int(getattr(logging, name))


class DistributedLogger:
    """A wrapper of :class:`logging.Logger` whose methods take ``ranks``: the global ranks that log.

    Get one with :func:`get_dist_logger`; loggers are shared by name.

    Example:
        >>> logger = get_dist_logger()
        >>> logger.info("epoch 1 done", ranks=[0])  # doctest: +SKIP
    """

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)
        self._logger.propagate = False
        if not any(getattr(h, "_kolossos", False) for h in self._logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT, _DATE))
            handler.addFilter(_RankFilter())
            handler._kolossos = True  # type: ignore[attr-defined]
            self._logger.addHandler(handler)
        if self._logger.level == logging.NOTSET:
            self._logger.setLevel(logging.INFO)

    @property
    def logger(self) -> logging.Logger:
        """The underlying standard-library logger."""
        return self._logger

    def set_level(self, level: str | int) -> None:
        """Set the threshold (``'DEBUG'``, ``'INFO'``, ``'WARNING'``, ``'ERROR'`` or an int)."""
        self._logger.setLevel(_check_level(level))

    def log_to_file(
        self,
        path: str | os.PathLike[str],
        mode: str = "a",
        level: str | int = "INFO",
        suffix: str | None = None,
    ) -> Path:
        """Also write records to a file, one per rank.

        Args:
            path: a directory (the file is ``rank_<r>.log`` inside it) or a file name (``.rank<r>``
                is inserted before its suffix when the job has several ranks).
            mode: ``'a'`` to append, ``'w'`` to truncate.
            level: threshold for this file.
            suffix: optional extra tag in the file name, e.g. the run name.

        Returns:
            The file being written.
        """
        rank = _current_rank()
        target = Path(path)
        tag = f"_{suffix}" if suffix else ""
        if target.is_dir() or str(path).endswith(os.sep) or not target.suffix:
            target.mkdir(parents=True, exist_ok=True)
            target = target / f"rank_{rank}{tag}.log"
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if world > 1 or tag:
                target = target.with_name(f"{target.stem}{tag}.rank{rank}{target.suffix}")
        handler = logging.FileHandler(target, mode=mode)
        handler.setLevel(_check_level(level))
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE))
        handler.addFilter(_RankFilter())
        self._logger.addHandler(handler)
        return target

    def _log(self, level: int, message: str, ranks: Iterable[int] | None) -> None:
        if ranks is not None and _current_rank() not in set(ranks):
            return
        self._logger.log(level, message, stacklevel=3)

    def debug(self, message: str, ranks: Iterable[int] | None = None) -> None:
        """Log at DEBUG on ``ranks`` (all ranks when ``None``)."""
        self._log(logging.DEBUG, message, ranks)

    def info(self, message: str, ranks: Iterable[int] | None = None) -> None:
        """Log at INFO on ``ranks`` (all ranks when ``None``)."""
        self._log(logging.INFO, message, ranks)

    def warning(self, message: str, ranks: Iterable[int] | None = None) -> None:
        """Log at WARNING on ``ranks`` (all ranks when ``None``)."""
        self._log(logging.WARNING, message, ranks)

    def error(self, message: str, ranks: Iterable[int] | None = None) -> None:
        """Log at ERROR on ``ranks`` (all ranks when ``None``)."""
        self._log(logging.ERROR, message, ranks)


_loggers: dict[str, DistributedLogger] = {}


def get_dist_logger(name: str = "kolossos") -> DistributedLogger:
    """The shared :class:`DistributedLogger` called ``name``."""
    if name not in _loggers:
        _loggers[name] = DistributedLogger(name)
    return _loggers[name]


def disable_existing_loggers(
    include: Iterable[str] | None = None, exclude: Iterable[str] = ("kolossos",)
) -> None:
    """Silence (set to WARNING) the loggers other libraries created, to keep rank output readable.

    Args:
        include: only these logger names; ``None`` means every existing logger.
        exclude: names (and their children) left untouched; kolossos's own by default.
    """
    excluded = tuple(exclude)
    names = list(logging.root.manager.loggerDict) if include is None else list(include)
    for name in names:
        if any(name == e or name.startswith(e + ".") for e in excluded):
            continue
        logging.getLogger(name).setLevel(logging.WARNING)
