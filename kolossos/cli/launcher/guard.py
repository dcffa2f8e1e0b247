"""Run a command as the root of a process tree and kill the whole tree when the launcher goes away.

``kolossos run`` starts one guard per node (directly for the local node, through ssh for the
others)::

    python -I .../kolossos/cli/launcher/guard.py [--grace SECONDS] -- COMMAND [ARG ...]

The guard stops COMMAND and *every* process below it (torchrun starts its workers in sessions of
their own, so a process-group kill would miss them) when

* its stdin reaches end-of-file: ``kolossos run`` holds the write end of that pipe, directly or
  through the ssh connection, so the launcher exiting, being killed, or closing the pipe on purpose,
  and the ssh connection dropping, all end the job on this node;
* it receives SIGTERM, SIGINT or SIGHUP.

Stopping means SIGTERM to every descendant, then SIGKILL to those still alive after ``--grace``
seconds. The guard marks itself a Linux "child subreaper", so processes orphaned by a dying
torchrun are re-parented to it and still found. When COMMAND ends by itself, leftover descendants
are swept the same way, and the guard exits with COMMAND's code (128 + N for a signal N).

This file runs by path on every node and imports only the standard library (not kolossos, not
torch), so it starts fast and does not depend on the package importing on that node.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

_PR_SET_CHILD_SUBREAPER = 36
_USAGE = "usage: guard.py [--grace SECONDS] -- COMMAND [ARG ...]"


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux only); return if it worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parent_map() -> dict[int, tuple[int, str]]:
    """Map every live pid to ``(ppid, state)`` by reading ``/proc``."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue  # the process ended while we looked
        # "pid (comm) state ppid ..."; comm may hold spaces and ')', so split after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2:
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(root: int) -> list[int]:
    """Return the pids of the live (non-zombie) processes below ``root``, parents first."""
    table = _parent_map()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        if table[pid][1] != "Z":
            found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(skip: int) -> None:
    """Collect exited orphans re-parented to us (but not ``skip``, which Popen owns)."""
    for pid, (ppid, state) in _parent_map().items():
        if ppid == os.getpid() and pid != skip and state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def kill_tree(child: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM every descendant of this process; SIGKILL what is left after ``grace`` seconds."""
    me = os.getpid()
    _signal_all(descendants(me), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        child.poll()
        _reap(child.pid)
        if not descendants(me):
            return
        time.sleep(0.05)
    for _ in range(100):  # SIGKILL cannot be ignored; loop only to catch late forks
        left = descendants(me)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.05)
        child.poll()
        _reap(child.pid)
    child.wait()


def _watch_stdin(stop: threading.Event) -> None:
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    stop.set()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _parse(argv: list[str]) -> tuple[float, list[str]]:
    grace = 5.0
    if argv[:1] == ["--grace"] and len(argv) >= 2:
        grace = float(argv[1])
        argv = argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        raise SystemExit(_USAGE)
    return grace, argv[1:]


def main(argv: list[str] | None = None) -> int:
    """Run the guarded command; return its exit code (see the module docstring)."""
    grace, command = _parse(list(sys.argv[1:] if argv is None else argv))
    become_subreaper()
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    while child.poll() is None and not stop.wait(0.1):
        pass
    if child.poll() is None:
        reason = f"signal {received[0]}" if received else "launcher connection closed"
        with contextlib.suppress(OSError):  # stderr may have gone with the ssh connection
            print(f"kolossos guard: stopping {command[0]} ({reason})", file=sys.stderr, flush=True)
        kill_tree(child, grace)
        return 128 + received[0] if received else 143
    kill_tree(child, grace)  # sweep stragglers (normally none)
    return _exit_code(child.returncode)


if __name__ == "__main__":
    sys.exit(main())
