"""``kolossos serve MODEL_DIR [--tp N] [--pp N] [--port P] [--host H]``: an OpenAI-compatible
completion server for a local Hugging Face causal LM (GPT-2, OPT, LLaMA), tensor-parallel over
``--tp`` processes per pipeline stage and pipeline-parallel over ``--pp`` stages.

With ``--tp`` x ``--pp`` = N > 1 processes, this process is rank 0: it starts ranks 1..N-1 as
child processes (the same command with a hidden ``--rank``), joins them in a process group, and
runs the HTTP server; the others run the decoding loop, receiving each step's batch from rank 0.
SIGINT or SIGTERM on rank 0 stops the server, ends the loop on every rank, and waits for the
children (killed after ``--shutdown-grace`` seconds). The children ignore SIGINT (a Ctrl-C
reaches the whole terminal process group; rank 0 decides) and die with rank 0 if it is killed.

``MODEL_DIR`` may instead be a ``CONFIG.py`` with Energon-AI's ``opt_config.py`` keys
(:mod:`kolossos.cli.serve_config`); options given on the command line override its keys.

Example::

    kolossos serve ./opt-125m --tp 2 --port 8020
    kolossos serve ./opt_config.py
    curl localhost:8020/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "Hello", "max_tokens": 16, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from kolossos.cli.serve_config import ServeConfigError, read_serve_config

PROG = "kolossos serve"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
INSTALL_HINT = "kolossos serve needs FastAPI and uvicorn: pip install 'kolossos[serve]'"


def build_parser() -> argparse.ArgumentParser:
    """The ``kolossos serve`` argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a local Hugging Face causal LM (GPT-2, OPT, LLaMA) over an "
        "OpenAI-compatible HTTP API (POST /v1/completions, /v1/chat/completions, GET /health, "
        "/docs), "
        "tensor-parallel over --tp processes per stage, pipeline-parallel over --pp stages.",
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR",
        help="a save_pretrained folder + tokenizer, or a CONFIG.py with Energon-AI's opt_config.py "
        "keys (model_class, checkpoint, tp_init_size, ...; command-line options override it)",
    )  # fmt: skip
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1); --tp x --pp "
                   "processes in all")  # fmt: skip
    p.add_argument("--port", type=int, default=8020, help="HTTP port (default 8020)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    p.add_argument("--executor-max-batch-size", type=int, default=8, help="requests per batch")
    p.add_argument("--cache-size", type=int, default=50, help="LRU result cache keys (0: off)")
    p.add_argument("--cache-list-size", type=int, default=2, help="results kept per key")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--model-name", default=None, help="the API's model name (default: folder)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: MODEL_DIR)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rdzv-port", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """Linux: deliver SIGTERM to this child when rank 0 exits, however it exits."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _spawn_ranks(argv: list[str], args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    base = [sys.executable, "-m", "kolossos.cli.serve", *argv]
    return [
        subprocess.Popen([*base, "--rank", str(rank), "--rdzv-port", str(args.rdzv_port)])
        for rank in range(1, args.tp * args.pp)
    ]


def _engine(args: argparse.Namespace) -> Any:
    import kolossos
    from kolossos.accelerator import get_accelerator
    from kolossos.inference import InferenceConfig, InferenceEngine

    world = args.tp * args.pp
    if world > 1:
        kolossos.launch(
            {}, rank=args.rank, world_size=world, host="127.0.0.1", port=args.rdzv_port,
            backend=get_accelerator().communication_backend, verbose=False, timeout=300,
        )  # fmt: skip
    config = InferenceConfig(
        tp_size=args.tp, pp_size=args.pp, max_batch_size=args.executor_max_batch_size
    )
    return InferenceEngine(args.model_dir, config)


def _scheduler(args: argparse.Namespace, engine: Any) -> Any:
    from kolossos.inference.batching import BatchingConfig
    from kolossos.inference.scheduler import Scheduler

    config = BatchingConfig(
        mode=args.batching,
        executor_max_batch_size=args.executor_max_batch_size,
        cache_size=args.cache_size,
        cache_list_size=args.cache_list_size,
    )
    return Scheduler(engine, config)


def _serve(args: argparse.Namespace, scheduler: Any) -> None:
    import transformers
    import uvicorn

    from kolossos.inference.http_api import ApiLimits, create_app
    from kolossos.inference.sharding import context_length

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        args.tokenizer or args.model_dir, local_files_only=True, trust_remote_code=False
    )
    limits = ApiLimits(
        model_name=args.model_name or Path(args.model_dir).resolve().name,
        context=context_length(scheduler.engine.model),
        timeout_s=args.timeout,
    )
    app = create_app(scheduler, tokenizer, limits, run_loop=False)
    # uvicorn re-raises the SIGINT/SIGTERM that stopped it through the handlers it found: make
    # those no-ops so the shutdown of the other ranks below still runs
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5
    )
    uvicorn.Server(config).run()


def _check(args: argparse.Namespace) -> str | None:
    for flag in ("tp", "pp"):
        if getattr(args, flag) < 1:
            return f"--{flag} {getattr(args, flag)} must be >= 1"
    if args.executor_max_batch_size < 1 or args.cache_size < 0 or args.cache_list_size < 1:
        return (
            "--executor-max-batch-size and --cache-list-size must be >= 1, --cache-size >= 0 "
            "(0 turns the result cache off)"
        )
    if not args.timeout > 0:
        return f"--timeout {args.timeout} must be > 0 seconds"
    folder = Path(args.model_dir)
    if not (folder / "config.json").is_file():
        return f"{args.model_dir!r} is not a Hugging Face model folder (no config.json)"
    tokenizer = Path(args.tokenizer or args.model_dir)
    if not any((tokenizer / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"{str(tokenizer)!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save the "
            "model's tokenizer into it with tokenizer.save_pretrained(MODEL_DIR)"
        )
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def _apply_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> str | None:
    """With ``MODEL_DIR`` a ``.py`` file: its keys set the options not given on the command
    line; the problem with the file, if any."""
    path = Path(args.model_dir)
    if path.suffix != ".py":
        return None
    if not path.is_file():
        return f"config file {args.model_dir!r} does not exist"
    try:
        options = read_serve_config(path)
    except ServeConfigError as err:
        return str(err)
    given = {
        action.dest
        for action in parser._actions
        for flag in action.option_strings
        if any(arg == flag or arg.startswith(flag + "=") for arg in argv)
    }
    for option, value in options.items():
        if option not in given:
            setattr(args, option, value)
    return None


def main(argv: list[str]) -> int:
    """Run ``kolossos serve``; 0 after a clean shutdown, 2 for a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _apply_config(parser, args, argv)
    problem = problem or _check(args)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    if args.rank > 0:  # a worker rank: decode what rank 0 sends until it says stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with_parent()
        scheduler = _scheduler(args, _engine(args))
        scheduler.run()
        _close()
        return 0
    children: list[subprocess.Popen[bytes]] = []
    clean = True
    if args.tp * args.pp > 1:
        args.rdzv_port = _free_port()
        children = _spawn_ranks(argv, args)
    try:
        scheduler = _scheduler(args, _engine(args))
        loop = threading.Thread(target=scheduler.run, name="kolossos-serve-loop", daemon=True)
        loop.start()
        try:
            _serve(args, scheduler)
        finally:
            scheduler.stop()
            loop.join(timeout=args.shutdown_grace)
        _close()
    finally:
        clean = _reap(children, args.shutdown_grace)
    return 0 if clean else 1


def _close() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _reap(children: list[subprocess.Popen[bytes]], grace: float) -> bool:
    """Wait for the worker ranks, killing any still running after ``grace`` seconds; ``True``
    when every one exited by itself with status 0."""
    clean = True
    for child in children:
        try:
            clean &= child.wait(timeout=grace) == 0
        except subprocess.TimeoutExpired:
            print(f"{PROG}: rank pid {child.pid} did not exit; killing it", file=sys.stderr)
            child.kill()
            child.wait()
            clean = False
    return clean


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
