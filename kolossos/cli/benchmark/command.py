"""``kolossos benchmark``: argument parsing, the checks made before any process starts, the
job's launch and the report.

The layouts of ``--nproc`` ranks are enumerated (:mod:`~kolossos.cli.benchmark.layouts`); those
the sizes do not fit are reported as skipped with the rule they break; the others run in one job
of ``--nproc`` processes under the launcher ``kolossos run`` uses (torchrun, gloo on the CPU,
NCCL on GPUs), one layout after the other (:mod:`~kolossos.cli.benchmark.worker`). Then the
table is printed and, with ``--json PATH``, the same figures are written as JSON. The exit code
is 0 when every layout ran or was skipped, 1 when a layout failed (its error is in the table), 2
for bad options (nothing started).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from kolossos.cli.benchmark.layouts import Layout, enumerate_layouts, skip_reason
from kolossos.cli.benchmark.options import MODELS, BenchmarkOptions
from kolossos.cli.benchmark.report import (
    LayoutResult,
    aggregate,
    exit_code,
    format_table,
    missing,
    skipped,
    to_json,
)
from kolossos.cli.usage import explain_unknown

__all__ = ["PROG", "build_parser", "main", "parse_options", "plan_layouts"]

PROG = "kolossos benchmark"


class UsageError(Exception):
    """A bad option or value; the command prints it and exits with 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(explain_unknown(message, self))


def build_parser() -> argparse.ArgumentParser:
    """The ``kolossos benchmark`` argument parser (Colossal-AI's flags, with ``-`` spellings)."""
    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Tensor-parallel micro-benchmark: run an MLP on input (batch_size, seq_len, "
        "dimension) under every tensor-parallel layout N processes allow (data parallel, 1d, "
        "2d, 2.5d, 3d) and print the time per step, peak memory and bytes communicated.",
        epilog="Example: kolossos benchmark --nproc 8 --dimension 2048 --json bench.json",
    )
    p.add_argument(
        "--nproc",
        "--gpus",
        "-g",
        type=int,
        default=None,
        metavar="N",
        help="processes (one per GPU on a GPU machine; any number on the CPU)",
    )
    p.add_argument(
        "--batch_size",
        "--batch-size",
        "-b",
        type=int,
        default=8,
        metavar="B",
        help="batch size of the input (default 8)",
    )
    p.add_argument(
        "--seq_len",
        "--seq-len",
        "-s",
        type=int,
        default=512,
        metavar="S",
        help="sequence length of the input (default 512)",
    )
    p.add_argument(
        "--dimension",
        "-d",
        type=int,
        default=1024,
        metavar="D",
        help="hidden size of the input and of every layer (default 1024)",
    )
    p.add_argument(
        "--warmup_steps",
        "--warmup-steps",
        "-w",
        type=int,
        default=10,
        metavar="K",
        help="untimed steps first (default 10)",
    )
    p.add_argument(
        "--profile_steps",
        "--profile-steps",
        "-p",
        type=int,
        default=50,
        metavar="K",
        help="timed steps (default 50)",
    )
    p.add_argument(
        "--layers",
        "-l",
        type=int,
        default=2,
        metavar="L",
        help="Linear(D, D) layers in the MLP (default 2)",
    )
    p.add_argument(
        "--model",
        "-m",
        default="mlp",
        metavar="NAME",
        help=f"the model to benchmark: {', '.join(MODELS)} (default mlp)",
    )
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the results as JSON to PATH")  # fmt: skip
    return p


def parse_options(argv: list[str]) -> tuple[BenchmarkOptions, Path | None]:
    """The checked options and the ``--json`` path.

    Raises:
        UsageError: a bad option or value, naming it, the rule and the fix.
    """
    args = build_parser().parse_args(argv)
    if args.nproc is None:
        raise UsageError("--nproc is required: the number of processes (GPUs) to benchmark on, "
                         "e.g. kolossos benchmark --nproc 4.")  # fmt: skip
    try:
        options = BenchmarkOptions(
            nproc=args.nproc, batch_size=args.batch_size, seq_len=args.seq_len,
            dimension=args.dimension, warmup_steps=args.warmup_steps,
            profile_steps=args.profile_steps, layers=args.layers, model=args.model,
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    json_path = None if args.json is None else Path(args.json)
    if json_path is not None and not json_path.resolve().parent.is_dir():
        raise UsageError(f"--json {args.json}: the folder {json_path.resolve().parent} does not "
                         "exist; create it or pass another path.")  # fmt: skip
    return options, json_path


def plan_layouts(options: BenchmarkOptions) -> tuple[list[Layout], dict[str, str]]:
    """Every layout of ``options.nproc`` ranks, and the reason each skipped one cannot run."""
    layouts = enumerate_layouts(options.nproc)
    reasons = {}
    for layout in layouts:
        reason = skip_reason(layout, options.sizes)
        if reason is not None:
            reasons[layout.name] = reason
    return layouts, reasons


def _check_processes(nproc: int) -> None:
    """The process count against this machine's cores, and its GPUs when it has any (NCCL
    runs one process per device)."""
    from kolossos.accelerator import get_accelerator
    from kolossos.cli.launcher.errors import LaunchConfigError
    from kolossos.cli.launcher.limits import check_nproc

    try:
        check_nproc(nproc, local=True, what=f"--nproc {nproc}")
        accelerator = get_accelerator()
    except (LaunchConfigError, ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    count = accelerator.device_count()
    if accelerator.name != "cpu" and nproc > count:
        raise UsageError(
            f"--nproc {nproc} starts more processes than the {count} {accelerator.name} "
            f"device(s) visible here; each process needs its own. Pass --nproc {count} or less, "
            "or set KOLOSSOS_ACCELERATOR=cpu to benchmark on the CPU with gloo."
        )


def _run_job(options: BenchmarkOptions, layouts: list[Layout], folder: Path) -> dict[str, Any]:
    """Run the layouts in one job of ``options.nproc`` processes; the worker's results file
    (empty when the job wrote none)."""
    from kolossos.cli.launcher.plan import LaunchPlan
    from kolossos.cli.launcher.restarts import run_with_restarts
    from kolossos.cli.train_job import free_port

    job, out = folder / "job.json", folder / "results.json"
    job.write_text(json.dumps({
        "options": options.as_dict(), "layouts": [layout.as_dict() for layout in layouts]
    }))  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nproc)))
    plan = LaunchPlan(
        hosts=[], nproc_per_node=options.nproc, master_addr="127.0.0.1",
        master_port=free_port(), script="kolossos.cli.benchmark.worker",
        script_args=["--job", str(job), "--out", str(out)], extra_flags=["--module"],
    )  # fmt: skip
    code = run_with_restarts(plan, 0, prog=PROG)
    if code != 0:
        print(f"{PROG}: the benchmark job exited with code {code}", file=sys.stderr)
    return json.loads(out.read_text()) if out.exists() else {}


def _results(
    layouts: list[Layout], reasons: dict[str, str], measured: dict[str, Any]
) -> list[LayoutResult]:
    by_name = {entry["layout"]["name"]: entry for entry in measured.get("results", [])}
    results = []
    for layout in layouts:
        if layout.name in reasons:
            results.append(skipped(layout, reasons[layout.name]))
        elif layout.name in by_name:
            results.append(aggregate(by_name[layout.name]["layout"], by_name[layout.name]["ranks"]))
        else:
            results.append(missing(layout, "the job ended before this layout reported"))
    return results


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    """Run ``kolossos benchmark`` with ``argv`` (the words after ``benchmark``); return the exit
    code: 0 when every layout ran or was skipped, 1 when one failed, 2 for bad options."""
    try:
        options, json_path = parse_options(argv)
        _check_processes(options.nproc)
        layouts, reasons = plan_layouts(options)
        if len(reasons) == len(layouts):
            lines = [f"  {layout.label}: {reasons[layout.name]}" for layout in layouts]
            raise UsageError("no layout fits these sizes:\n" + "\n".join(lines))
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    if options.nproc == 1:
        print(f"{PROG}: note: with 1 process no layout communicates; tensor parallelism needs "
              "--nproc 2 or more.", file=sys.stderr)  # fmt: skip
    to_run = [layout for layout in layouts if layout.name not in reasons]
    names = ", ".join(layout.label for layout in to_run)
    print(f"{PROG}: {len(to_run)} layout(s) on {options.nproc} process(es): {names}",
          file=sys.stderr, flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kolossos-benchmark-") as folder:
        measured = _run_job(options, to_run, Path(folder))
    results = _results(layouts, reasons, measured)
    environment = measured.get("environment", {})
    print(format_table(results, options, environment), flush=True)
    if json_path is not None:
        _write_json(json_path, to_json(results, options, environment))
    return exit_code(results)
