"""How ``kolossos train`` runs its job on this machine: the worker processes under the launcher,
relaunched after a failure from the run's latest complete checkpoint (``--max_restarts``), with
the first failing rank's report kept for the final message.

No torch import here: the command line stays quick until the workers start.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from dataclasses import dataclass

from kolossos.cli.launcher.plan import LaunchPlan
from kolossos.cli.launcher.restarts import RESTART_ENV, run_with_restarts
from kolossos.launch_env import WATCHDOG_ENV
from kolossos.train.exit_codes import NOT_RETRIED
from kolossos.train.failures import first_failure
from kolossos.train.paths import RunPaths

__all__ = ["JobOutcome", "free_port", "run_job"]

PROG = "kolossos train"


@dataclass(frozen=True)
class JobOutcome:
    """How the job ended."""

    code: int
    """The exit code of the last attempt."""
    failure: str | None
    """The first failing rank's one-line report in the last attempt, if a rank recorded one."""
    restarts: int
    """Relaunches made."""


def free_port() -> int:
    """A TCP port that is free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_args(config_json: str, resume: bool) -> list[str]:
    return ["--config", config_json, *(["--resume"] if resume else [])]


def run_job(
    paths: RunPaths,
    nproc: int,
    *,
    port: int | None,
    resume: bool,
    max_restarts: int = 0,
    watchdog_s: float | None = None,
) -> JobOutcome:
    """Run the workers of the run in ``paths`` (its resolved config) and wait for them.

    Args:
        paths: the prepared run folder.
        nproc: processes to start.
        port: the rendezvous port (``None``: a free one, chosen again for each attempt).
        resume: the first attempt continues from the latest complete checkpoint.
        max_restarts: relaunches after a failure (not after a configuration error, a stop by
            the numerics guard or a Ctrl-C: see :data:`~kolossos.train.exit_codes.NOT_RETRIED`);
            each continues from the latest complete checkpoint, or starts afresh without one.
        watchdog_s: the progress watchdog's time (``None``: ``KOLOSSOS_WATCHDOG`` if set).
    """
    from kolossos.train.quiet import StderrFilter

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if watchdog_s is not None:
        os.environ[WATCHDOG_ENV] = f"{watchdog_s:g}"
    plan = LaunchPlan(
        hosts=[],
        nproc_per_node=nproc,
        master_addr="127.0.0.1",
        master_port=port or free_port(),
        script="kolossos.train.worker",
        script_args=_worker_args(str(paths.config), resume),
        extra_flags=["--module"],  # torchrun runs the worker as a module: no sys.path surprises
    )
    started = [time.time()]

    def before(attempt: int, plan: LaunchPlan) -> LaunchPlan:
        if attempt == 0:
            return plan
        failure = first_failure(paths.root, started[0])
        if failure is not None:
            print(f"{PROG}: {failure.line()}", file=sys.stderr, flush=True)
        latest = paths.latest_checkpoint()
        where = f"from {latest[1]} (step {latest[0]})" if latest else "from the start"
        print(f"{PROG}: restarting {where}", file=sys.stderr, flush=True)
        started[0] = time.time()
        return dataclasses.replace(
            plan,
            master_port=port or free_port(),
            script_args=_worker_args(str(paths.config), latest is not None),
        )

    with StderrFilter():
        code = run_with_restarts(
            plan,
            max_restarts,
            before=before,
            restartable=lambda code: code not in NOT_RETRIED,
            prog=PROG,
        )
    failure = first_failure(paths.root, started[0]) if code != 0 else None
    restarts = int(os.environ.get(RESTART_ENV, "0"))
    return JobOutcome(code, None if failure is None else failure.line(), restarts)
