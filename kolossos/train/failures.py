"""What a failing rank of ``kolossos train`` reports, so a failure ends the job in seconds and the
user reads the first failure's message, not a collective timeout.

A rank whose step raises prints one line (rank, where, exception) and its traceback to its
standard error, records the same in ``RUN/.failures/rank_NNNNN.json`` and leaves at once, without
entering another collective (a barrier there would wait for peers that wait elsewhere). Its peers
see the connection close and stop; the launcher reads the records and names the earliest one.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

__all__ = ["FAILURES_DIR", "Failure", "first_failure", "report_failure"]

FAILURES_DIR = ".failures"


@dataclass(frozen=True)
class Failure:
    """One rank's failure."""

    rank: int
    """The global rank that failed."""
    time: float
    """When (seconds since the epoch)."""
    kind: str
    """The exception's type."""
    message: str
    """The exception's message (first 500 characters)."""
    where: str
    """The innermost frame in kolossos (or the innermost frame): ``file:line in function``."""

    def line(self) -> str:
        """The one-line summary."""
        return f"rank {self.rank} failed at {self.where}: {self.kind}: {self.message}"


def report_failure(
    exc: BaseException, rank: int, root: Path | None, stream: TextIO | None = None
) -> Failure:
    """Print ``exc`` as this rank's failure (summary line, then the traceback) and record it in
    ``root/.failures`` (when ``root`` is given and writable); return the record."""
    from kolossos.cluster.rank_failure import where  # torch: only the failing worker needs it

    text = str(exc).strip().replace("\n", " ")
    failure = Failure(rank, time.time(), type(exc).__name__, text[:500], where(exc))
    out = stream or sys.stderr
    print(f"kolossos train: {failure.line()}", file=out, flush=True)
    traceback.print_exception(exc, file=out)
    out.flush()
    if root is not None:
        folder = root / FAILURES_DIR
        try:
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / f"rank_{rank:05d}.json"
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_text(json.dumps(asdict(failure), sort_keys=True), encoding="utf-8")
            os.replace(tmp, target)
        except OSError:
            pass  # the report on stderr stands; the file is a convenience for the launcher
    return failure


def first_failure(root: Path, since: float) -> Failure | None:
    """The earliest failure recorded in ``root/.failures`` at or after ``since`` (a launch's
    start time), or ``None``. Unreadable records are skipped."""
    found = []
    folder = root / FAILURES_DIR
    if not folder.is_dir():
        return None
    for path in folder.glob("rank_*.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            failure = Failure(**record)
        except (OSError, ValueError, TypeError):
            continue
        if failure.time >= since:
            found.append(failure)
    return min(found, key=lambda f: f.time) if found else None
