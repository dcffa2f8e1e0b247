"""The per-rank entry point of ``kolossos train``, started by the launcher on every process::

    python -m torch.distributed.run ... -m kolossos.trainer.worker --config RUN/config.json

``--config`` is the resolved configuration that ``kolossos train`` validated and wrote before
starting any process. SIGINT and SIGTERM ask for a clean stop: every rank finishes the current
step, they agree to stop through the step's all-reduce, and the process exits with 130 (the last
complete checkpoint stays as it was). A second SIGINT interrupts at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch.distributed as dist

from kolossos.trainer.config import TrainConfig
from kolossos.trainer.errors import ConfigError
from kolossos.trainer.loop import StopFlag, Trainer
from kolossos.trainer.schema import config_from_dict

__all__ = ["EXIT_CONFIG", "EXIT_INTERRUPTED", "main", "run_worker"]

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
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


def _lost_peer(exc: BaseException) -> bool:
    text = str(exc).lower()
    markers = ("connection", "closed by peer", "broken pipe", "timed out", "timeout")
    return isinstance(exc, RuntimeError) and any(m in text for m in markers)


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
    from kolossos.trainer.report import banner, finish
    from kolossos.trainer.setup import build_run

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
        (printed by rank 0), 1 when another rank was lost.
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
    except Exception as exc:
        if not _lost_peer(exc) and not stop.requested:
            raise
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        print(
            f"kolossos train: rank {rank} stopped: lost contact with another rank "
            f"({type(exc).__name__}: {first_line})",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Read the resolved config file and train; used under the launcher (one call per rank)."""
    parser = argparse.ArgumentParser(prog="python -m kolossos.trainer.worker")
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
        return run_worker(config, args.resume)
    finally:
        _leave()


def _leave() -> None:
    """Tear the process group down together: a rank that destroys its group while a peer still
    works can die in gloo's destructors (seen as SIGABRT at exit)."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # a lost peer: nothing left to wait for
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
