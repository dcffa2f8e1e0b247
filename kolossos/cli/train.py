"""``kolossos train``: train a GPT from a config file on N processes (the built-in default
without one).

The configuration is read, validated and checked against the process count before anything
starts; then the worker (:mod:`kolossos.train.worker`) runs on ``--nproc_per_node`` processes
through the same launcher as ``kolossos run``. Under ``torchrun`` (or ``kolossos run``) the
command trains in the current process instead, which is how it runs on several machines.

Example::

    kolossos train                                   # the built-in Shakespeare GPT, 2 processes
    kolossos train examples/configs/gpt_shakespeare.py train.steps=200 --nproc_per_node 4
    kolossos train my.toml --resume                  # continue after Ctrl-C or a failure
    kolossos train my.toml --resume=auto             # continue if there is a checkpoint
    kolossos train examples/configs/llama_tiny_finetune.py   # fine-tune a local HF model

Everything that can be checked without starting a process is checked first, and a problem ends
the command with exit code 2 and one paragraph naming the value, the rule and the fix: the
options (port, process count against this machine's cores or GPUs, ``--resume``), the whole
configuration, the plugin's keyword values, the corpus and the sample prompt, and the run folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from kolossos.cli.train_job import run_job

if TYPE_CHECKING:
    from kolossos.train.config import TrainConfig
    from kolossos.train.paths import RunPaths

PROG = "kolossos train"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        from kolossos.cli.usage import explain_unknown
        from kolossos.train.schema import all_keys

        raise _UsageError(explain_unknown(message, self, all_keys()))


#: the hidden option that ``--resume=auto`` (and ``--resume auto``) is rewritten to
_RESUME_AUTO = "--resume-auto"


def normalize_resume(argv: list[str]) -> list[str]:
    """``argv`` with ``--resume=auto`` / ``--resume auto`` spelled as one internal flag.

    Raises:
        _UsageError: ``--resume=VALUE`` with any other value.
    """
    out: list[str] = []
    for word in argv:
        if word.startswith("--resume="):
            value = word.partition("=")[2]
            if value != "auto":
                raise _UsageError(
                    f"--resume={value} is not allowed: write --resume (continue from the latest "
                    "checkpoint; an error if there is none) or --resume=auto (continue if there "
                    "is a checkpoint, else start fresh)."
                )
            word = _RESUME_AUTO
        elif word == "auto" and out and out[-1] == "--resume":
            out[-1] = _RESUME_AUTO
            continue
        out.append(word)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``kolossos train`` argument parser."""
    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Train a GPT model, or a local Hugging Face causal LM (model.pretrained), "
        "from a config file (.py, .toml, .yaml or .json) with key=value overrides; without a "
        "file, the built-in character-level GPT on Shakespeare.",
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
        "--resume",
        action="store_const",
        const="must",
        default="no",
        help="continue the run from its latest complete checkpoint (an error if it has none); "
        "--resume=auto: continue if there is one, else start fresh",
    )
    p.add_argument(_RESUME_AUTO, dest="resume", action="store_const", const="auto",
                   help=argparse.SUPPRESS)  # fmt: skip
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
        "--max_restarts",
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="after a failure, relaunch up to K times from the latest complete checkpoint "
        "(default 0)",
    )
    p.add_argument(
        "--watchdog",
        default=None,
        metavar="SECONDS",
        help="end the job when a rank makes no progress for SECONDS while its peers finished or "
        "wait for it, printing its stack (default: off)",
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


def _without_resume(argv: list[str]) -> list[str]:
    words = normalize_resume([a for a in argv if not a.startswith("--resume=")])
    return [a for a in words if a not in ("--resume", _RESUME_AUTO)]


def resume_command(argv: list[str]) -> str:
    """The command that resumes the run started with ``argv``."""
    kept = [a for a in _without_resume(argv) if a != "--overwrite"]
    return shlex.join(["kolossos", "train", *kept, "--resume"])


def _stopped_message(
    code: int,
    paths_root: str,
    latest: tuple[int, object] | None,
    argv: list[str],
    failure: str | None = None,
) -> str:
    why = (
        "it was interrupted" if code in (130, 143, 129) else f"a process failed (exit code {code})"
    )
    if failure is not None:
        why += f": {failure}"
    if latest is None:
        where = f"no checkpoint was completed in {paths_root} yet, so nothing can be resumed"
        return f"{PROG}: the job stopped because {why}; {where}. Start again with: " + shlex.join(
            ["kolossos", "train", *_without_resume(argv)]
        )
    return (
        f"{PROG}: the job stopped because {why}. The last complete checkpoint is {latest[1]} "
        f"(step {latest[0]}); resume with:\n    {resume_command(argv)}"
    )


def _refuse_launch_flags(args: argparse.Namespace) -> None:
    """Under a launcher the processes and the port are the launcher's: refuse ours."""
    given = [
        f"{flag} {value}"
        for flag, value in (
            ("--nproc_per_node", args.nproc_per_node),
            ("--master_port", args.master_port),
            ("--max_restarts", args.max_restarts or None),
            ("--watchdog", args.watchdog),
        )
        if value is not None
    ]
    if given:
        raise _UsageError(
            f"{' and '.join(given)}: kolossos train runs under a launcher here (torchrun or "
            "kolossos run set RANK and WORLD_SIZE), which starts the processes and chooses the "
            "port. Pass these options to the launcher instead."
        )


def _job_flags(args: argparse.Namespace) -> None:
    """Check ``--max_restarts`` and ``--watchdog``; store the watchdog time as
    ``args.watchdog_s``."""
    from kolossos.launch_env import parse_watchdog

    if args.max_restarts < 0:
        raise _UsageError(
            f"--max_restarts {args.max_restarts} is invalid: it counts relaunches after a "
            "failure; pass 0 (the default: no restart) or more."
        )
    try:
        args.watchdog_s = (
            None if args.watchdog is None else parse_watchdog(args.watchdog, "--watchdog")
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _check_processes(config: TrainConfig, from_flag: bool) -> None:
    """The process count against this machine: its CPU cores, and its GPUs when the run uses
    them (one device per process; NCCL refuses two processes on one device)."""
    from kolossos.accelerator import get_accelerator
    from kolossos.cli.launcher.errors import LaunchConfigError
    from kolossos.cli.launcher.limits import check_nproc

    nproc = config.nproc_per_node
    what = f"--nproc_per_node {nproc}" if from_flag else f"nproc_per_node = {nproc} (the config's)"
    try:
        check_nproc(nproc, local=True, what=what)
    except LaunchConfigError as exc:
        raise _UsageError(str(exc)) from None
    try:
        accelerator = get_accelerator()
    except (ValueError, RuntimeError) as exc:  # a bad KOLOSSOS_ACCELERATOR
        raise _UsageError(str(exc)) from None
    count = accelerator.device_count()
    if accelerator.name != "cpu" and nproc > count:
        raise _UsageError(
            f"{what} starts more processes than the {count} {accelerator.name} device(s) "
            "visible here; every process trains on a device of its own. Pass --nproc_per_node "
            f"{count} or less, or set KOLOSSOS_ACCELERATOR=cpu to train on the CPU with gloo."
        )


def _fit_default_to_devices(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """The built-in default's process count, lowered to the GPUs visible on a machine with
    fewer of them (one GPU: one process), unless an override set it; a CPU run keeps it."""
    from kolossos.accelerator import get_accelerator

    if any(item.split("=", 1)[0].strip() == "nproc_per_node" for item in overrides):
        return config
    try:
        accelerator = get_accelerator()
    except (ValueError, RuntimeError):  # a bad KOLOSSOS_ACCELERATOR: _check_processes says so
        return config
    count = accelerator.device_count()
    if accelerator.name == "cpu" or not 0 < count < config.nproc_per_node:
        return config
    return dataclasses.replace(config, nproc_per_node=count)


def _check_port(port: int | None, *, free: bool) -> None:
    from kolossos.cli.launcher.errors import LaunchConfigError
    from kolossos.cli.launcher.limits import check_port, check_port_free

    if port is None:
        return
    try:
        check_port(port, "--master_port")
        if free:
            check_port_free(port, "--master_port")
    except LaunchConfigError as exc:
        raise _UsageError(f"{exc} Leave --master_port out to use a free port.") from None


def _prepare(args: argparse.Namespace, rank0: bool) -> tuple[TrainConfig, RunPaths, bool] | int:
    """Read and check the options, the configuration, the corpus and the run folder, and
    decide whether the run resumes; an exit code when done (or refused)."""
    from kolossos.train.config_files import load_config
    from kolossos.train.errors import ConfigError
    from kolossos.train.prelaunch import (
        check_config,
        check_data,
        check_dependencies,
        prepare_run_folder,
        resolve_resume,
        with_nproc,
    )
    from kolossos.train.schema import config_to_dict

    under = _under_launcher()
    try:
        if under:
            _refuse_launch_flags(args)
        _job_flags(args)
        _check_port(args.master_port, free=False)
        path, overrides = split_items(args.items)
        config = with_nproc(load_config(path, overrides), args.nproc_per_node)
        if not under and path is None and args.nproc_per_node is None:
            config = _fit_default_to_devices(config, overrides)
        if not under:
            _check_processes(config, from_flag=args.nproc_per_node is not None)
        check_config(config, int(os.environ["WORLD_SIZE"]) if under else config.nproc_per_node)
        if args.print_config:
            print(json.dumps(config_to_dict(config), indent=2))
            return 0
        check_dependencies(config)
        resume = resolve_resume(config, args.resume, overwrite=args.overwrite)
        check_data(config, resume=resume)
        _check_port(args.master_port, free=True)
        paths = prepare_run_folder(config, resume=resume, overwrite=args.overwrite, write=rank0)
    except (ConfigError, _UsageError) as exc:
        if rank0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return config, paths, resume


def _train_here(config: TrainConfig, resume: bool) -> int:
    """Train in this process, which a launcher (torchrun, kolossos run) started."""
    import torch.distributed as dist

    from kolossos.train.worker import run_worker

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
        args = build_parser().parse_intermixed_args(normalize_resume(argv))
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
    config, paths, resume = prepared
    failure = None
    if under:
        code = _train_here(config, resume)
    else:
        outcome = run_job(
            paths,
            config.nproc_per_node,
            port=args.master_port,
            resume=resume,
            max_restarts=args.max_restarts,
            watchdog_s=args.watchdog_s,
        )
        code, failure = outcome.code, outcome.failure
    if code not in (0, 2) and rank0:
        latest = paths.latest_checkpoint()
        message = _stopped_message(code, str(paths.root), latest, argv, failure)
        print(message, file=sys.stderr, flush=True)
    elif code == 0 and rank0 and not under:
        print(f"{PROG}: done in {time.monotonic() - t0:.0f} s (wall time, start-up included)")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
