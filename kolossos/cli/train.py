"""``kolossos train``: train a GPT from a config file on N processes (the built-in default
without one).

The configuration is read, validated and checked against the process count before anything
starts; then the worker (:mod:`kolossos.trainer.worker`) runs on ``--nproc_per_node`` processes
through the same launcher as ``kolossos run``. Under ``torchrun`` (or ``kolossos run``) the
command trains in the current process instead, which is how it runs on several machines.

Example::

    kolossos train                                   # the built-in Shakespeare GPT, 2 processes
    kolossos train examples/configs/gpt_shakespeare.py train.steps=200 --nproc_per_node 4
    kolossos train my.toml --resume                  # continue after Ctrl-C or a failure
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import time
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from kolossos.trainer.config import TrainConfig
    from kolossos.trainer.paths import RunPaths

PROG = "kolossos train"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``kolossos train`` argument parser."""
    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Train a GPT model from a config file (.py, .toml, .yaml or .json) with "
        "key=value overrides; without a file, the built-in character-level GPT on Shakespeare.",
        epilog="Example: kolossos train examples/configs/gpt_shakespeare.toml train.steps=200 "
        "--nproc_per_node 2. Docs: docs/getting-started.md",
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="CONFIG | key=value",
        help="a config file, then dotted overrides such as model.n_layer=2",
    )
    p.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="processes to start (default: the config's nproc_per_node, 2)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the run from its latest complete checkpoint"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run's previous checkpoints and outputs and start again",
    )
    p.add_argument(
        "--master_port",
        "--master-port",
        type=int,
        default=None,
        metavar="PORT",
        help="rendezvous port (default: a free one)",
    )
    p.add_argument(
        "--print-config",
        "--print_config",
        action="store_true",
        help="print the resolved configuration as JSON and exit",
    )
    return p


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """Separate the config path (the one item without ``=``) from the overrides.

    Raises:
        _UsageError: more than one path.
    """
    paths = [item for item in items if "=" not in item]
    overrides = [item for item in items if "=" in item]
    if len(paths) > 1:
        raise _UsageError(
            f"more than one config file given ({', '.join(paths)}); pass one file, and "
            "overrides as key=value"
        )
    return (paths[0] if paths else None), overrides


def _under_launcher() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def resume_command(argv: list[str]) -> str:
    """The command that resumes the run started with ``argv``."""
    kept = [a for a in argv if a not in ("--overwrite", "--resume")]
    return shlex.join(["kolossos", "train", *kept, "--resume"])


def _stopped_message(
    code: int, paths_root: str, latest: tuple[int, object] | None, argv: list[str]
) -> str:
    why = (
        "it was interrupted" if code in (130, 143, 129) else f"a process failed (exit code {code})"
    )
    if latest is None:
        where = f"no checkpoint was completed in {paths_root} yet, so nothing can be resumed"
        return f"{PROG}: the job stopped because {why}; {where}. Start again with: " + shlex.join(
            ["kolossos", "train", *[a for a in argv if a != "--resume"]]
        )
    return (
        f"{PROG}: the job stopped because {why}. The last complete checkpoint is {latest[1]} "
        f"(step {latest[0]}); resume with:\n    {resume_command(argv)}"
    )


def _launch(config_json: str, nproc: int, port: int | None, resume: bool) -> int:
    from kolossos.cli.launcher.multinode import run_nodes
    from kolossos.cli.launcher.plan import LaunchPlan
    from kolossos.trainer.quiet import StderrFilter

    plan = LaunchPlan(
        hosts=[],
        nproc_per_node=nproc,
        master_addr="127.0.0.1",
        master_port=port or _free_port(),
        script="kolossos.trainer.worker",
        script_args=["--config", config_json, *(["--resume"] if resume else [])],
        extra_flags=["--module"],  # torchrun runs the worker as a module: no sys.path surprises
    )
    env_threads = str(max(1, (os.cpu_count() or 1) // nproc))
    os.environ.setdefault("OMP_NUM_THREADS", env_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with StderrFilter():
        return run_nodes(plan.node_commands())


def _prepare(args: argparse.Namespace, rank0: bool) -> tuple[TrainConfig, RunPaths] | int:
    """Read, validate and check the configuration and the run folder; an exit code when done."""
    from kolossos.trainer.config_files import load_config
    from kolossos.trainer.errors import ConfigError
    from kolossos.trainer.prelaunch import (
        check_config,
        check_dependencies,
        prepare_run_folder,
        with_nproc,
    )
    from kolossos.trainer.schema import config_to_dict

    try:
        path, overrides = split_items(args.items)
        config = with_nproc(load_config(path, overrides), args.nproc_per_node)
        under = _under_launcher()
        check_config(config, int(os.environ["WORLD_SIZE"]) if under else config.nproc_per_node)
        if args.print_config:
            print(json.dumps(config_to_dict(config), indent=2))
            return 0
        check_dependencies(config)
        paths = prepare_run_folder(
            config, resume=args.resume, overwrite=args.overwrite, write=rank0
        )
    except (ConfigError, _UsageError) as exc:
        if rank0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return config, paths


def _train_here(config: TrainConfig, resume: bool) -> int:
    """Train in this process, which a launcher (torchrun, kolossos run) started."""
    import torch.distributed as dist

    from kolossos.trainer.worker import run_worker

    try:
        return run_worker(config, resume)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """Run ``kolossos train`` with ``argv`` (the words after ``train``); return the exit code.

    0: trained; 2: a usage or configuration error (printed; nothing started); 130 (or 128 + N):
    stopped by a signal; otherwise the failing process's code. After a stop, the message says
    how to resume.
    """
    t0 = time.monotonic()
    try:
        args = build_parser().parse_intermixed_args(argv)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    under = _under_launcher()
    rank0 = not under or os.environ.get("RANK") == "0"
    prepared = _prepare(args, rank0)
    if isinstance(prepared, int):
        return prepared
    config, paths = prepared
    if under:
        code = _train_here(config, args.resume)
    else:
        code = _launch(str(paths.config), config.nproc_per_node, args.master_port, args.resume)
    if code not in (0, 2) and rank0:
        message = _stopped_message(code, str(paths.root), paths.latest_checkpoint(), argv)
        print(message, file=sys.stderr, flush=True)
    elif code == 0 and rank0 and not under:
        print(f"{PROG}: done in {time.monotonic() - t0:.0f} s (wall time, start-up included)")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
