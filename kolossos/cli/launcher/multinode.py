"""Start one process per node and supervise them: one failure, or a signal, stops them all.

Every node process (the local guard, or ssh running the remote guard) gets a stdin pipe that this
process holds open; closing it is how a node is told to stop (see
:mod:`kolossos.cli.launcher.guard`).
If ``kolossos run`` itself dies, the kernel closes those pipes, so the nodes stop as well.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.guard import descendants
from kolossos.cli.launcher.plan import GUARD_GRACE_S, NodeCommand

#: Seconds to wait for the nodes to stop after their pipes closed, before SIGKILL.
STOP_TIMEOUT_S = GUARD_GRACE_S + 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_Handler = Callable[[int, FrameType | None], object] | int | None


def _say(message: str) -> None:
    print(f"kolossos run: {message}", file=sys.stderr, flush=True)


def check_ssh_available(nodes: Sequence[NodeCommand]) -> None:
    """Raise :class:`LaunchConfigError` if a node needs ssh and no ``ssh`` client is on PATH."""
    if any(node.remote for node in nodes) and shutil.which("ssh") is None:
        raise LaunchConfigError(
            "a remote host was given but no 'ssh' client is on PATH; install OpenSSH "
            "(e.g. apt-get install openssh-client) or run on the local host only."
        )


class _Supervisor:
    """The running node processes plus the stop request set by signal handlers."""

    def __init__(self, nodes: Sequence[NodeCommand]) -> None:
        self.nodes = list(nodes)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stop = threading.Event()
        self.signals: list[int] = []

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signals.append(signum)
        self.stop.set()

    def start(self) -> None:
        for node in self.nodes:
            # A session of its own: a Ctrl-C in the terminal reaches only us, and we stop the
            # nodes in order (pipes first, SIGKILL last).
            proc = subprocess.Popen(node.argv, stdin=subprocess.PIPE, start_new_session=True)
            self.procs.append(proc)

    def wait(self, poll_s: float = 0.1) -> int:
        """Block until all nodes succeeded (0), one failed (its code) or a signal came (128+N)."""
        while True:
            codes = [proc.poll() for proc in self.procs]
            for node, code in zip(self.nodes, codes, strict=True):
                if code is not None and code != 0:
                    others = sum(1 for c in codes if c is None)
                    _say(
                        f"node {node.node_rank} ({node.host}) exited with code {code}"
                        + (f"; stopping the other {others} node(s)" if others else "")
                        + (
                            " (255 is ssh's own failure: check the ssh setup)"
                            if code == 255
                            else ""
                        )
                    )
                    return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            if self.stop.wait(poll_s):
                _say(f"received signal {self.signals[0]}; stopping all nodes")
                return 128 + self.signals[0]

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Close every node's pipe, wait up to ``timeout_s``, then SIGKILL what is left."""
        first_signals = len(self.signals)
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(self.signals) == first_signals:
            if all(proc.poll() is not None for proc in self.procs):
                return
            time.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                _kill_tree_now(proc.pid)
                proc.wait()


def _kill_tree_now(pid: int) -> None:
    """SIGKILL ``pid``'s session and every process below it (found before the kill)."""
    victims = [pid, *descendants(pid)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for victim in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)


def run_nodes(nodes: Sequence[NodeCommand]) -> int:
    """Run the node commands to completion and return the job's exit code.

    0 when every node succeeded; the first failing node's code otherwise (the others are stopped);
    128 + N after signal N (SIGINT, SIGTERM or SIGHUP) stopped the job.
    """
    supervisor = _Supervisor(nodes)
    previous: dict[signal.Signals, _Handler] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            previous[sig] = signal.signal(sig, supervisor.on_signal)
    try:
        supervisor.start()
        return supervisor.wait()
    except OSError as exc:
        _say(f"could not start a node process: {exc}")
        return 1
    finally:
        supervisor.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
