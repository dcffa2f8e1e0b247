"""Run a function on N local processes (ranks) and report the first failure with its rank.

Ranks are **forked** from the calling process when that is safe (no CUDA context in the parent), so
they inherit everything the parent imported: a distributed test then costs well under a second
instead of the 5–15 s of re-importing torch in ``spawn``-ed children. The parent hosts the
rendezvous ``TCPStore`` itself, on a port the kernel picked and that stays bound for the whole
run, so two tests can never race for a port; ranks connect to it as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``, the same arrangement torchrun uses), so
``kolossos.launch(..., host="localhost", port=port)`` and ``env://`` both work inside ``fn``.

Guarantees: a per-run wall-clock timeout (hung ranks' Python stacks are included in the error);
when a rank raises or dies, the others are killed at once and the error names the rank and carries
its traceback; every rank runs in its own process group and dies with the parent, so nothing is
left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import inspect
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "KOLOSSOS_TEST_TIMEOUT"
_PR_SET_PDEATHSIG = 1


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message names the rank and carries its traceback."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def default_timeout() -> float:
    """``$KOLOSSOS_TEST_TIMEOUT`` seconds, else 300."""
    raw = os.environ.get(TIMEOUT_ENV)
    return float(raw) if raw else DEFAULT_TIMEOUT_S


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: rely on the parent's kill
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    kwargs: dict[str, Any],
    conn: Connection,
    stack_dir: str,
    parent_pid: int,
    collective_timeout: float,
) -> None:
    """Body of one rank: environment, run ``fn``, report, and exit without running the parent's
    atexit handlers (pytest's, when forked from a test session)."""
    code = 0
    try:
        os.setpgrp()
        _die_with_parent(parent_pid)
        stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")  # noqa: SIM115 (lives until exit)
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            OMP_NUM_THREADS="1",
        )
        os.environ.setdefault("KOLOSSOS_DIST_TIMEOUT", str(collective_timeout))
        torch.set_num_threads(1)
        result = _call(fn, rank, world_size, port, kwargs)
        try:
            # plain pickle sends tensors by value: torch's multiprocessing reducers would share
            # them through file descriptors that die with this process
            payload = pickle.dumps(("ok", result))
        except Exception:  # an unpicklable return value is not the test's failure
            payload = pickle.dumps(("ok", None))
        conn.send_bytes(payload)
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt included
        code = 1
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with contextlib.suppress(Exception):  # the parent may be gone already
            conn.send_bytes(pickle.dumps(("error", text)))
    finally:
        _destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _call(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, kwargs: dict[str, Any]
) -> Any:
    """``fn(rank, world_size, port, **kwargs)``; ``world_size`` and ``port`` go by keyword when
    ``fn`` has parameters of those names, as Colossal-AI's ``spawn`` passes them (so
    ``def check(rank, model_cls, world_size, port)`` gets each value in the right place)."""
    if _takes_by_keyword(fn, ("world_size", "port")):
        return fn(rank, world_size=world_size, port=port, **kwargs)
    return fn(rank, world_size, port, **kwargs)


def _takes_by_keyword(fn: Callable[..., Any], names: tuple[str, ...]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: keep the positional call
        return False
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return all(n in params and params[n].kind in keyword_kinds for n in names)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # best effort while exiting
            dist.destroy_process_group()


def _start_method() -> str:
    # Forking a process that owns a CUDA context breaks the children: fall back to spawn then.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "spawn"
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _kill(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def _stacks(procs: list[Any], stack_dir: Path) -> str:
    alive = [(r, p) for r, p in enumerate(procs) if p.is_alive()]
    for _, proc in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(0.5)  # let faulthandler write the stacks
    parts = []
    for rank, _ in alive:
        text = (stack_dir / f"rank{rank}.txt").read_text(errors="replace").strip()
        parts.append(f"--- rank {rank} stack ---\n{text or '(no stack written)'}")
    return "\n".join(parts)


def spawn(
    fn: Callable[..., Any],
    world_size: int = 1,
    *,
    timeout: float | None = None,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, port, **kwargs)`` on ``world_size`` processes and wait for all.

    Colossal-AI's form ``spawn(fn, nprocs=N, **kwargs)`` works too: ``nprocs`` is another name
    for ``world_size``. When ``fn`` has parameters named ``world_size`` and ``port`` they are
    passed by keyword (as Colossal-AI does), otherwise by position.

    Args:
        fn: the per-rank function; it usually calls ``kolossos.launch(config={}, rank=rank,
            world_size=world_size, host="localhost", port=port)`` first.
        world_size: number of ranks (or ``nprocs=``, Colossal-AI's keyword).
        timeout: wall-clock limit in seconds for the whole run (default ``$KOLOSSOS_TEST_TIMEOUT``
            or 300). Collectives inside get the same limit through ``KOLOSSOS_DIST_TIMEOUT``.
        start_method: ``"fork"`` (default where safe) or ``"spawn"`` (``fn`` must be picklable).
        **kwargs: passed to ``fn`` (except ``nprocs``, read as ``world_size``).

    Returns:
        Each rank's return value (``None`` where it cannot be pickled), in rank order.

    Raises:
        RankError: a rank raised (its traceback is in the message), died, or the run timed out
            (the stacks of the ranks still running are in the message).
        ValueError: the number of ranks is not an int >= 1, or ``nprocs`` and a different
            positional ``world_size`` are both given.

    Example:
        >>> def work(rank, world_size, port):
        ...     return rank * 10
        >>> spawn(work, 2)
        [0, 10]
        >>> spawn(work, nprocs=2)
        [0, 10]
    """
    world_size = _world_size(world_size, kwargs)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1.")
    limit = default_timeout() if timeout is None else float(timeout)
    # The rendezvous port is bound (chosen by the kernel) before any rank starts, so there is no
    # port race; the store's server thread starts only after the last fork, because forking a
    # process that runs threads can leave the children deadlocked on locks held at fork time.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    port = listener.getsockname()[1]
    holder: list[Any] = []  # the store; cleared in `finally` even if a traceback keeps this frame
    ctx = mp.get_context(start_method or _start_method())
    with tempfile.TemporaryDirectory(prefix="kolossos-spawn-") as stack_dir:
        procs, conns = [], []
        try:
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                args = (fn, rank, world_size, port, kwargs, send, stack_dir, os.getpid(), limit)
                proc = ctx.Process(  # type: ignore[attr-defined]
                    target=_rank_main, args=args, name=f"kolossos-rank{rank}"
                )
                proc.start()
                send.close()
                procs.append(proc)
                conns.append(recv)
            holder.append(_serve_store(listener, port, world_size))
            return _collect(procs, conns, limit, Path(stack_dir))
        finally:
            _kill(procs)
            holder.clear()
            listener.close()


def _world_size(world_size: int, kwargs: dict[str, Any]) -> int:
    """``world_size``, or Colossal-AI's ``nprocs=`` (removed from ``kwargs``: upstream never
    passes it to the rank function either)."""
    if "nprocs" not in kwargs:
        return world_size
    nprocs: int = kwargs.pop("nprocs")
    # world_size's default is 1, so only a different positional value is a visible conflict
    if world_size not in (1, nprocs):
        raise ValueError(
            f"spawn got world_size={world_size!r} and nprocs={nprocs!r}: pass one of them "
            "(nprocs is Colossal-AI's name for world_size)."
        )
    return nprocs


def _serve_store(listener: socket.socket, port: int, world_size: int) -> Any:
    """Start the rendezvous ``TCPStore`` server on the already listening socket."""
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=os.dup(listener.fileno()),
    )


def _receive(conn: Connection, rank: int, procs: list[Any]) -> tuple[str, Any]:
    try:
        status, payload = pickle.loads(conn.recv_bytes())
    except EOFError:
        procs[rank].join(timeout=5)
        code = procs[rank].exitcode
        reason = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return "error", f"exited ({reason}) without reporting: killed, crashed or os._exit\n"
    return status, payload


def _collect(procs: list[Any], conns: list[Connection], limit: float, stack_dir: Path) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    deadline = time.monotonic() + limit
    waiting: dict[Any, int] = {conn: rank for rank, conn in enumerate(conns)}
    while waiting:
        remaining = deadline - time.monotonic()
        if failures:  # after a first failure, wait briefly for the others' reports, then stop
            remaining = min(remaining, 1.0)
        ready = wait(list(waiting), timeout=remaining) if remaining > 0 else []
        if not ready:
            break
        for conn in ready:
            rank = waiting.pop(conn)
            status, payload = _receive(conn, rank, procs)  # type: ignore[arg-type]
            if status == "error":
                failures.append((rank, payload))
            else:
                results[rank] = payload
    world = len(procs)
    if failures:
        first_rank = failures[0][0]
        text = "\n".join(f"=== rank {r} of {world} failed ===\n{t}" for r, t in failures)
        raise RankError(f"rank {first_rank} of {world} failed first.\n{text}", first_rank)
    if waiting:
        ranks = sorted(waiting.values())
        raise RankError(
            f"timed out after {limit:g} s waiting for rank(s) {ranks} of {world}; raise the limit "
            f"with timeout= or ${TIMEOUT_ENV} if the work is genuinely slow.\n"
            f"{_stacks(procs, stack_dir)}"
        )
    return [results[r] for r in range(world)]
