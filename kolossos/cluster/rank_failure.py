"""What a rank does when an exception escapes: say which rank failed, where and why (with every
rank's last collective when a peer was lost or a collective timed out), and end the process
within seconds even if tearing the process group down would wait for peers.

:func:`install_failure_hook` is called by :func:`kolossos.launch` for jobs of several processes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import traceback
from types import TracebackType

from kolossos.cluster.watchdog import collective_report

__all__ = [
    "EXIT_GRACE_S",
    "failure_line",
    "install_failure_hook",
    "is_lost_peer",
    "where",
]

#: seconds a failed rank may spend in interpreter shutdown before it is ended
EXIT_GRACE_S = 10.0
_LOST_PEER = ("connection", "closed by peer", "broken pipe", "timed out", "timeout")
_installed: list[int] = []  # the rank whose hook is installed in this process


def is_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is how a collective reports a lost peer or a timeout."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _LOST_PEER)


def where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost kolossos frame of ``exc``'s traceback (the
    innermost frame when none is in kolossos)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    marker = f"{os.sep}kolossos{os.sep}"
    ours = [f for f in frames if marker in f.filename]
    frame = (ours or frames)[-1]
    at = frame.filename.rfind(marker)
    short = frame.filename[at + 1 :] if at >= 0 else os.path.basename(frame.filename)
    return f"{short}:{frame.lineno} in {frame.name}"


def failure_line(exc: BaseException, rank: int) -> str:
    """``rank R failed at WHERE: Kind: message`` (the message on one line, at most 500
    characters)."""
    text = str(exc).strip().replace("\n", " ")[:500]
    return f"rank {rank} failed at {where(exc)}: {type(exc).__name__}: {text}"


def install_failure_hook(rank: int) -> None:
    """Report an uncaught exception of this rank and bound its shutdown (once per process).

    After the usual traceback, one line names the rank, the place and the exception; for a lost
    peer or a timeout, the table of every rank's last collective follows (see
    :func:`kolossos.cluster.watchdog.collective_report`). The interpreter then shuts down as
    usual, but at most :data:`EXIT_GRACE_S` seconds: a process group whose teardown waits for a
    peer stuck elsewhere would otherwise keep the rank, and the job, alive until the collective
    timeout.
    """
    if _installed:
        return
    _installed.append(rank)
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(kind, exc, tb)
        if isinstance(exc, KeyboardInterrupt):
            return
        print(f"kolossos: {failure_line(exc, rank)}", file=sys.stderr, flush=True)
        if is_lost_peer(exc):
            report = collective_report()
            if report:
                print(report, file=sys.stderr, flush=True)
        stream = sys.__stderr__ or sys.stderr
        with contextlib.suppress(ValueError, OSError, AttributeError):  # no usable descriptor
            faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=stream)

    sys.excepthook = hook
