"""Heartbeats between the ranks of a job: a progress watchdog, and the collective report that
names the stuck rank when a collective fails or times out.

Every rank launched by :func:`kolossos.launch` runs a :class:`Heartbeat`: a daemon thread that
every ``interval`` seconds writes this rank's state into the job's rendezvous store (its own
connection; the training thread is never blocked) — host, pid, ``running``/``finished`` and its
last collective per process group from torch's flight recorder
(:mod:`kolossos.cluster.flight_recorder`).

With a watchdog time ``N`` (``KOLOSSOS_WATCHDOG=N``, ``kolossos run --watchdog N``,
``kolossos train --watchdog N``) the thread also checks this rank's progress. A rank that has not
entered a new collective for ``N`` seconds while a peer has finished, has gone (the store is
unreachable), or waits in a collective this rank never entered, prints why, its Python stack (all
threads) and every rank's last collective, and exits with :data:`EXIT_WATCHDOG`; the launcher
then ends the job. ``N`` must exceed the longest legitimate pause between two collectives (a
checkpoint written by one rank, a long evaluation on one rank): the watchdog cannot tell those
from a hang. A job whose ranks all wait in the same collective is left to the collective timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, TextIO

import torch.distributed as dist

from kolossos.cluster import flight_recorder as fr
from kolossos.cluster.flight_recorder import LastCollective
from kolossos.launch_env import WATCHDOG_ENV, watchdog_seconds

__all__ = [
    "EXIT_WATCHDOG",
    "WATCHDOG_ENV",
    "Heartbeat",
    "active_heartbeat",
    "collective_report",
    "start_heartbeat",
]

#: the exit code of a rank the watchdog ended (``timeout``'s code)
EXIT_WATCHDOG = 124
#: seconds between heartbeats without a watchdog (only the failure report reads them)
IDLE_INTERVAL_S = 2.0
_STORE_TIMEOUT = timedelta(seconds=10)
_active: list[Heartbeat] = []  # this process's heartbeat (at most one), see active_heartbeat()


def _job_key() -> str:
    """Keys of one attempt of one job: torch elastic's run id and restart count."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    return f"kolossos/heartbeat/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class Heartbeat:
    """This rank's heartbeat thread (see the module docstring).

    Args:
        store: a store client of the job's own (not shared with the process group).
        rank, world_size: this process's place in the world.
        watchdog_s: the watchdog time, or ``None`` for heartbeats only.
        stream: where a watchdog report goes (default: the process's standard error).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        watchdog_s: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.watchdog_s = watchdog_s
        quick = IDLE_INTERVAL_S if watchdog_s is None else max(0.1, watchdog_s / 10)
        self.interval_s = min(IDLE_INTERVAL_S, quick)
        self.stream = stream
        self.prefix = _job_key()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one store request at a time on our connection
        self._thread = threading.Thread(target=self._run, name="kolossos-heartbeat", daemon=True)
        self._progress: tuple[tuple[str, int], ...] | None = None
        self._since = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Heartbeat:
        """Publish the first beat and start the thread."""
        self.publish()
        self._thread.start()
        return self

    def finish(self) -> None:
        """Stop the thread and publish ``finished`` (registered to run at exit).

        The thread is joined first: a daemon thread still inside a store request while the
        interpreter tears its objects down would abort the process.
        """
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=_STORE_TIMEOUT.total_seconds() + 5)
        with contextlib.suppress(Exception):
            self.publish("finished")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            collectives = fr.local_collectives() or {}
            try:
                self._write("running", collectives)
            except Exception:  # the store is gone: the job's rendezvous host has exited
                if self.watchdog_s is None:
                    return
            if self.watchdog_s is not None:
                self._check(collectives)

    # ------------------------------------------------------------------ beats
    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def publish(self, state: str = "running") -> None:
        """Write this rank's beat now."""
        self._write(state, fr.local_collectives() or {})

    def _write(self, state: str, collectives: dict[str, LastCollective]) -> None:
        beat = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "state": state,
            "time": time.time(),
            "collectives": fr.to_dict(collectives),
        }
        with self._lock:
            self.store.set(self._key(self.rank), json.dumps(beat))

    def read_all(self) -> dict[int, dict[str, Any]]:
        """Every rank's latest beat (ranks that never published are absent)."""
        out: dict[int, dict[str, Any]] = {}
        with self._lock:
            for rank in range(self.world_size):
                key = self._key(rank)
                if self.store.check([key]):
                    with contextlib.suppress(ValueError):
                        out[rank] = json.loads(self.store.get(key))
        return out

    # ------------------------------------------------------------------ the watchdog
    def _check(self, collectives: dict[str, LastCollective]) -> None:
        now = time.monotonic()
        progress = tuple(sorted((k, c.seq) for k, c in collectives.items()))
        if progress != self._progress:
            self._progress, self._since = progress, now
            return
        assert self.watchdog_s is not None
        if now - self._since < self.watchdog_s:
            return
        reason, beats = self._why_stuck()
        if reason is not None:
            self._fire(reason, beats, now - self._since)

    def _why_stuck(self) -> tuple[str | None, dict[int, dict[str, Any]]]:
        """Why this rank counts as stuck (``None``: it does not), and the beats read."""
        try:
            beats = self.read_all()
        except Exception:
            return "the job's rendezvous store is unreachable (its host process has exited)", {}
        done = sorted(r for r, b in beats.items() if r != self.rank and b["state"] == "finished")
        if done:
            return f"rank(s) {', '.join(map(str, done))} finished", beats
        behind = fr.stragglers(_collectives_of(beats))
        if self.rank in behind:
            return behind[self.rank], beats
        return None, beats

    def _fire(self, reason: str, beats: dict[int, dict[str, Any]], idle_s: float) -> None:
        out = self.stream or sys.__stderr__ or sys.stderr
        print(
            f"kolossos watchdog: rank {self.rank} (host {socket.gethostname()}, pid "
            f"{os.getpid()}) made no progress for {idle_s:.0f} s (the limit is "
            f"{self.watchdog_s:g} s, {WATCHDOG_ENV}) while {reason}; ending the job. Its "
            "Python stack:",
            file=out,
            flush=True,
        )
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=out, all_threads=True)
        if beats:
            print(fr.describe(_collectives_of(beats)), file=out, flush=True)
        os._exit(EXIT_WATCHDOG)


def _collectives_of(beats: dict[int, dict[str, Any]]) -> dict[int, dict[str, LastCollective]]:
    return {rank: fr.from_dict(beat.get("collectives", {})) for rank, beat in beats.items()}


def active_heartbeat() -> Heartbeat | None:
    """This process's running heartbeat, if :func:`start_heartbeat` started one."""
    return _active[0] if _active else None


def start_heartbeat(rank: int, world_size: int, host: str, port: int) -> Heartbeat | None:
    """Start this process's heartbeat against the job's store at ``host:port`` (once per
    process; later calls return the running one). ``None`` for a single process, or when the
    store cannot be reached (the job runs without heartbeats then).

    Raises:
        ValueError: a bad :data:`WATCHDOG_ENV` value.
    """
    seconds = watchdog_seconds()
    if _active:
        return _active[0]
    if world_size < 2:
        return None
    try:
        store = dist.TCPStore(
            host, port, is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False
        )
    except (RuntimeError, OSError, ValueError):
        return None
    try:
        beat = Heartbeat(store, rank, world_size, seconds).start()
    except (RuntimeError, OSError):
        return None
    _active.append(beat)
    atexit.register(beat.finish)
    return beat


def collective_report() -> str | None:
    """Every rank's last collective as the heartbeats tell it, with the ranks behind named;
    this rank's own record only without heartbeats; ``None`` without a flight record."""
    beat = active_heartbeat()
    if beat is not None:
        with contextlib.suppress(Exception):
            beat.publish()
            beats = beat.read_all()
            if beats:
                return fr.describe(_collectives_of(beats))
    mine = fr.local_collectives()
    if not mine:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return fr.describe({rank: mine})
