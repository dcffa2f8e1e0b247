"""The run's metrics: one JSON object per line in ``metrics.jsonl`` (written by rank 0).

Record kinds::

    {"kind": "train", "step": 10, "loss": 3.1, "lr": 0.0005, "tokens_per_s": 8123.0,
     "mem_bytes": [412000000, 409000000], "elapsed_s": 12.4}
    {"kind": "val", "step": 100, "val_loss": 2.41}

``loss`` of a train record is the mean training loss of that step over all ranks. On resume, the
records after the checkpoint's step are dropped (they belong to the interrupted attempt), so the
file of a resumed run equals the file of an uninterrupted one apart from timings.

With ``metrics.tensorboard = true`` every number of every record is also written as a
TensorBoard scalar tagged ``<kind>/<key>`` (``train/loss``, ``val/val_loss``,
``train/mem_bytes/rank0``, ...) at its step, through a :class:`ScalarWriter` such as
``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

__all__ = ["MetricsLog", "ScalarWriter", "read_metrics", "tensorboard_writer"]


class ScalarWriter(Protocol):
    """What :class:`MetricsLog` needs of a TensorBoard writer."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...

    def flush(self) -> None: ...


def tensorboard_writer(log_dir: Path, purge_step: int | None = None) -> ScalarWriter:
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``log_dir``.

    Args:
        log_dir: the folder of the event files.
        purge_step: on resume, the first step written again; TensorBoard hides the events at
            and after it from the interrupted attempt.

    Raises:
        ModuleNotFoundError: ``tensorboard`` is not installed (``kolossos train`` checks this
            before launch and names ``pip install tensorboard``).
    """
    from torch.utils.tensorboard import SummaryWriter

    writer: ScalarWriter = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
    return writer


def _scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """``(tag, value)`` of every number in ``record`` (a list becomes one tag per rank)."""
    kind = record.get("kind", "other")
    out: list[tuple[str, float]] = []
    for key, value in sorted(record.items()):
        if key in ("kind", "step") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out.append((f"{kind}/{key}", float(value)))
        elif isinstance(value, list):
            out += [
                (f"{kind}/{key}/rank{rank}", float(v))
                for rank, v in enumerate(value)
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics file (a torn last line, from a killed run, is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """Appends records to ``metrics.jsonl`` and keeps them for the plot and the summary.

    Args:
        path: the JSONL file.
        resume_step: keep the existing records up to this step (``None``: start a new file).
        scalars: also write every number to this TensorBoard writer (``None``: only the file).
    """

    def __init__(
        self, path: Path, resume_step: int | None = None, scalars: ScalarWriter | None = None
    ) -> None:
        self.path = path
        self.scalars = scalars
        self.records: list[dict[str, Any]] = []
        if resume_step is not None:
            self.records = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
        path.parent.mkdir(parents=True, exist_ok=True)
        self._rewrite()

    def rewind(self, step: int) -> None:
        """Forget the records after ``step`` (a rollback replays them), in memory and on disk."""
        self.records = [r for r in self.records if r.get("step", 0) <= step]
        self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in self.records)
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushed at once, so a crash loses at most the line being
        written)."""
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
        if self.scalars is not None:
            step = int(record.get("step", 0))
            for tag, value in _scalars(record):
                self.scalars.add_scalar(tag, value, step)
            self.scalars.flush()  # a killed run keeps what it has shown

    def series(self, kind: str, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` of ``key`` over the records of ``kind``."""
        return [(int(r["step"]), float(r[key])) for r in self.records if r.get("kind") == kind]

    def plot(self, path: Path, title: str = "") -> str:
        """Write the loss curves to ``path``; return the renderer used."""
        from kolossos.train.plot import write_loss_plot

        return write_loss_plot(
            self.series("train", "loss"), self.series("val", "val_loss"), path, title
        )
