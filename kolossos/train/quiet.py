"""Keep torchrun's shutdown noise out of the user's terminal.

When ``kolossos train`` stops a job (Ctrl-C), torch elastic logs its own shutdown and ends with
a traceback of the ``SignalException`` it raises on purpose; when a worker fails, it prints a
``ChildFailedError`` traceback and a report of exit codes. None of that helps the user, whom the
failing rank's own report (:mod:`kolossos.train.failures`) and ``kolossos train`` tell what
happened and how to resume. :class:`StderrFilter` routes the job's standard error (file
descriptor 2, inherited by every process started inside it) through a thread that drops exactly
those lines and passes everything else through unchanged (the workers' tracebacks included).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from types import TracebackType

__all__ = ["StderrFilter", "is_noise"]

_ELASTIC_LOG = re.compile(
    r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ .*torch/distributed/elastic/.*(death signal|closing "
    r"signal|shutting down|failed \(exitcode)"
)
_SIGNAL_EXC = "torch.distributed.elastic.multiprocessing.api.SignalException"
_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_RULE = "=" * 20


def is_noise(block: list[str]) -> bool:
    """Whether a line, or a whole traceback block, is torch elastic's shutdown noise."""
    if len(block) == 1:
        return bool(_ELASTIC_LOG.match(block[0]))
    return block[-1].startswith((_SIGNAL_EXC, _CHILD_FAILED))


class StderrFilter:
    """A context manager that filters file descriptor 2 of this process and its children.

    Tracebacks are buffered until their final line (the exception) and dropped only when that
    is torch elastic's ``SignalException``; other lines pass through at once.
    """

    def __init__(self) -> None:
        self._saved = -1
        self._reader = -1
        self._thread: threading.Thread | None = None
        self._report_rules = 0  # rules of torch elastic's failure report still to drop through

    def __enter__(self) -> StderrFilter:
        read_fd, write_fd = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._reader = read_fd
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()
        return self

    def _emit(self, lines: list[str]) -> None:
        if not lines:
            return
        if self._report_rules:  # inside the exit-code report that follows ChildFailedError
            if lines[0].startswith(_RULE):
                self._report_rules -= 1
            return
        if is_noise(lines):
            if lines[-1].startswith(_CHILD_FAILED):
                self._report_rules = 2  # the report is framed by two rules of '='
            return
        with contextlib.suppress(OSError):
            os.write(self._saved, "".join(lines).encode(errors="replace"))

    def _pump(self) -> None:
        block: list[str] = []
        with os.fdopen(self._reader, "r", encoding="utf-8", errors="replace") as stream:
            for line in stream:
                if block:  # inside a traceback: its end is the first unindented line
                    block.append(line)
                    if not line.startswith((" ", "\t", "Traceback")):
                        self._emit(block)
                        block = []
                elif line.startswith("Traceback (most recent call last)"):
                    block = [line]
                else:
                    self._emit([line])
        self._emit(block)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        os.dup2(self._saved, 2)  # closes our write end: the pump sees EOF once children are gone
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(self._saved)
