"""The per-rank entry point of ``kolossos train``, started by the launcher on every process::

    python -m torch.distributed.run ... -m kolossos.train.worker --config RUN/config.json

``--config`` is the resolved configuration that ``kolossos train`` validated and wrote before
starting any process. SIGINT and SIGTERM ask for a clean stop: every rank finishes the current
step, they agree to stop through the step's all-reduce, and the process exits with 130 (the last
complete checkpoint stays as it was). A second SIGINT interrupts at once.

A rank that fails reports it (:mod:`kolossos.train.failures`) and exits at once, without
entering another collective; its peers then see the connection close and leave too, so a failure
ends the job in seconds instead of after the collective timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TextIO

import torch.distributed as dist

from kolossos.cluster.rank_failure import is_lost_peer
from kolossos.cluster.watchdog import collective_report
from kolossos.train.config import TrainConfig
from kolossos.train.errors import ConfigError
from kolossos.train.exit_codes import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
)
from kolossos.train.failures import report_failure
from kolossos.train.loop import StopFlag, Trainer
from kolossos.train.numerics import NonFiniteError
from kolossos.train.paths import RunPaths
from kolossos.train.schema import config_from_dict

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NONFINITE",
    "main",
    "run_worker",
]

_Handler = Callable[[int, FrameType | None], Any] | int | None


def _install_handlers(stop: StopFlag) -> dict[int, _Handler]:
    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if stop.signal is None:
            stop.signal = signum

    previous: dict[int, _Handler] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    return previous


def _start(config: TrainConfig) -> None:
    if dist.is_initialized():  # under a test harness, or a caller that launched already
        from kolossos.utils.seed import set_seed

        set_seed(config.seed)
        return
    import kolossos

    kolossos.launch_from_torch(config={}, seed=config.seed, verbose=False)


def _train(
    config: TrainConfig, resume: bool, stop: StopFlag, out: TextIO, live: bool | None
) -> int:
    from kolossos.train.report import banner, finish
    from kolossos.train.setup import build_run

    wall0 = time.monotonic()
    rank = dist.get_rank()
    parts = build_run(config)
    if rank == 0:
        print(banner(parts, dist.get_world_size()), file=out, flush=True)
    trainer = Trainer(parts, stop, out, live)
    result = trainer.run(resume)
    if result.interrupted:
        if rank == 0:
            last = result.last_checkpoint
            kept = f"the last complete checkpoint is {last}" if last else "no checkpoint yet"
            print(
                f"kolossos train: stopped after step {result.step}; {kept}.", file=out, flush=True
            )
        return EXIT_INTERRUPTED
    if rank == 0:
        assert trainer.metrics is not None
        text = finish(parts, result, trainer.metrics, time.monotonic() - wall0)
        print(text, file=out, flush=True)
    return 0


def run_worker(
    config: TrainConfig,
    resume: bool = False,
    *,
    stream: TextIO | None = None,
    live: bool | None = None,
    install_signals: bool = True,
    stop: StopFlag | None = None,
) -> int:
    """Train ``config`` on this rank; return the exit code.

    Args:
        config: the validated configuration.
        resume: continue from the run's latest complete checkpoint.
        stream: where rank 0 prints (default stdout); ``live`` forces in-place progress redraws.
        install_signals: handle SIGINT/SIGTERM as a clean stop (main thread only).
        stop: the stop flag to use (default: a new one, set by the signal handlers).

    Returns:
        0 when training finished, 130 when stopped by a signal, 2 for a configuration error
        (printed by rank 0), 3 when the numerics guard stopped the run (every rank agreed; the
        message is printed by rank 0), 1 when another rank was lost.

    Raises:
        Exception: whatever failed on this rank, after it was reported (summary line, traceback,
            ``RUN/.failures/rank_NNNNN.json``).
    """
    out = stream or sys.stdout
    stop = stop if stop is not None else StopFlag()
    previous = _install_handlers(stop) if install_signals else {}
    rank = 0
    try:
        _start(config)
        rank = dist.get_rank()
        return _train(config, resume, stop, out, live)
    except ConfigError as exc:
        if rank == 0:
            print(f"kolossos train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except NonFiniteError as exc:
        if rank == 0:
            print(f"kolossos train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except Exception as exc:
        if not is_lost_peer(exc) and not stop.requested:
            report_failure(exc, rank, RunPaths.of(config.output_dir, config.name).root)
            raise
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        print(
            f"kolossos train: rank {rank} stopped: lost contact with another rank "
            f"({type(exc).__name__}: {first_line})",
            file=sys.stderr,
            flush=True,
        )
        report = collective_report() if not stop.requested else None
        if report:  # names the rank the others waited for
            print(report, file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Read the resolved config file and train; used under the launcher (one call per rank)."""
    parser = argparse.ArgumentParser(prog="python -m kolossos.train.worker")
    parser.add_argument("--config", required=True, help="resolved config (JSON) to train")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    raw = json.loads(Path(args.config).read_text(encoding="utf-8"))
    try:
        config = config_from_dict(raw, source=args.config)
    except ConfigError as exc:
        print(f"kolossos train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    try:
        code = run_worker(config, args.resume)
    except BaseException:  # reported by run_worker (or a second Ctrl-C): leave now
        _abandon(EXIT_FAILED)
    if code not in (0, EXIT_INTERRUPTED):
        _abandon(code)  # peers may be inside another collective: do not wait for them
    _leave()
    return code


def _leave() -> None:
    """Tear the process group down together: a rank that destroys its group while a peer still
    works can die in gloo's destructors (seen as SIGABRT at exit). Only after a run every rank
    ended at the same point (finished, or stopped by the agreed vote)."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # a lost peer: nothing left to wait for
        dist.barrier()
    dist.destroy_process_group()


def _abandon(code: int) -> NoReturn:
    """Exit now, without collectives or destructors: the sockets close, so peers blocked in a
    collective with this rank fail at once instead of at the timeout."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
