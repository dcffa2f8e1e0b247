"""``python -m benchmarks [--quick] [--plot] [suite ...]``: run suites, report, save.

Each (suite, model) is one job: the ranks are forked from this process by
:func:`kolossos.testing.spawn` (after the heavy imports, so each rank starts in milliseconds),
share one process group, and run every available contender A/B/A/B (:mod:`benchmarks.harness`).
A suite whose optional dependency is missing here but present in the benchmark environment
(``.venv-bench``, from ``benchmarks/setup_deepspeed.sh``) is delegated to that interpreter.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.suites import SUITES, Suite, get_suite
from benchmarks.timing import INTERLEAVE_MODES

__all__ = ["main", "parse_args"]

ROOT = Path(__file__).resolve().parent.parent
QUICK_MODELS = ("gpt2-tiny", "resnet-tiny", "vit-tiny")
#: (batch per rank, steps, warmup, reps) for quick and full runs
QUICK, FULL = (4, 3, 1, 2), (4, 10, 2, 5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``python -m benchmarks --help``)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("suites", nargs="*", help=f"suites to run (default: all of {sorted(SUITES)})")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {', '.join(QUICK_MODELS)}, few steps (well under 2 min)",
    )
    p.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON file")
    p.add_argument(
        "--model",
        action="append",
        help="model name, repeatable (default: gpt2-50m; --quick: the tiny models)",
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument(
        "--rows",
        help="comma-separated row names: run only these of each suite (default: all)",
    )
    p.add_argument("--batch", type=int, help="samples per rank and step")
    p.add_argument("--steps", type=int, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, help="untimed steps before them")
    p.add_argument("--reps", type=int, help="A/B/A/B repetitions")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32, or bf16 autocast (parameters and optimizer states stay fp32)",
    )
    p.add_argument(
        "--interleave",
        choices=INTERLEAVE_MODES,
        default="step",
        help="A/B granularity: every step (all contenders alive) or every repetition",
    )
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores/ranks)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU")
    p.add_argument("--out", type=Path, help="JSON file (default: runs/benchmarks/<time>.json)")
    p.add_argument("--timeout", type=float, help="wall-clock limit per job in seconds")
    p.add_argument("--rows-out", type=Path, help=argparse.SUPPRESS)  # delegated runs
    args = p.parse_args(argv)
    for name in args.suites:
        if name not in SUITES:
            p.error(f"unknown suite {name!r}; choose from {sorted(SUITES)}")
    defaults = QUICK if args.quick else FULL
    for key, value in zip(("batch", "steps", "warmup", "reps"), defaults, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model_given = args.model is not None
    args.model = args.model or list(QUICK_MODELS if args.quick else ("gpt2-50m",))
    args.suites = args.suites or list(SUITES)
    cores = os.cpu_count() or 1
    args.threads = args.threads or max(1, cores // args.world_size)
    args.timeout = args.timeout or (300.0 if args.quick else 3600.0)
    if min(args.world_size, args.batch, args.steps, args.reps) < 1 or args.warmup < 0:
        p.error("--world-size, --batch, --steps and --reps must be >= 1 and --warmup >= 0")
    return args


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _prepare_parent(suites: list[Suite], models: list[str]) -> None:
    """One intra-op thread and the heavy imports before any fork (forked children of a process
    whose thread pool ran hang; children that inherit imports start in milliseconds)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ask NVML, not the CUDA driver, whether there are GPUs: a driver initialised in the parent
    # would make forked ranks fail to use CUDA.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    torch.set_num_threads(1)
    from kolossos.accelerator import get_accelerator

    if get_accelerator().name == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    names = ["torch.distributed", "kolossos.initialize", "benchmarks.harness"]
    for suite in suites:
        names += [m for m in suite.preimport if importlib.util.find_spec(m.split(".")[0])]
    if any(m.startswith("gpt2") for m in models):
        names.append("transformers.models.gpt2.modeling_gpt2")
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # the contender that needs it reports itself unavailable


def _bench_python() -> Path | None:
    """The benchmark environment's interpreter (``$KOLOSSOS_BENCH_VENV``, default .venv-bench);
    ``None`` if there is none, or it is the running one."""
    venv = os.environ.get("KOLOSSOS_BENCH_VENV", str(ROOT / ".venv-bench"))
    if not venv:
        return None
    python = Path(venv) / "bin" / "python"
    if not python.exists() or Path(sys.prefix).resolve() == Path(venv).resolve():
        return None
    return python


def _delegate(python: Path, suite: str, argv: list[str], models: list[str]) -> list[dict[str, Any]]:
    """Run ``suite`` in another interpreter; its rows come back through a file."""
    keep = [a for a in argv if a not in SUITES]
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.json"
        cmd = [str(python), "-m", "benchmarks", *keep, "--rows-out", str(rows_file), suite]
        _log(f"suite {suite}: delegated to {python}")
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, check=False)
        if rows_file.exists():
            rows: list[dict[str, Any]] = json.loads(rows_file.read_text())
            return rows
    reason = f"the delegated run in {python} exited {proc.returncode} without results"
    return [
        {"suite": suite, "model": model, "name": name, "status": "failed", "reason": reason}
        for model in models
        for name in get_suite(suite).contenders()
    ]


def _run_job(suite: Suite, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """All rows of one (suite, model) job."""
    import torch

    from benchmarks.contenders import Context
    from benchmarks.harness import JobPlan, rank_main
    from benchmarks.models import get_model
    from benchmarks.results import assemble_rows, base_row
    from kolossos.testing import spawn

    spec = get_model(model)
    contenders = suite.contenders()
    if args.rows:
        wanted = [name for name in args.rows.split(",") if name]
        contenders = {name: c for name, c in contenders.items() if name in wanted}
    plan = JobPlan(
        suite=suite.name,
        model=model,
        contenders=(),
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        reps=args.reps,
        precision=args.precision,
        threads=args.threads,
        timeout=args.timeout,
        interleave=args.interleave,
    )
    rows = {n: base_row(suite.name, spec, c, plan, args.world_size) for n, c in contenders.items()}
    runnable = []
    for name, contender in contenders.items():
        reason = contender.unavailable()  # e.g. DeepSpeed rows without deepspeed
        if reason is None and args.world_size < contender.min_world:
            reason = f"needs at least {contender.min_world} ranks (--world-size {args.world_size})"
        if reason:
            rows[name].update(status="skipped", reason=reason)
        else:
            runnable.append(contender)
    if runnable:
        plan = JobPlan(**{**vars(plan), "contenders": tuple(c.name for c in runnable)})
        _log(f"{suite.name}/{model}: {', '.join(plan.contenders)} on {args.world_size} ranks")
        start = time.perf_counter()
        try:
            raw = spawn(rank_main, args.world_size, timeout=args.timeout, plan=plan)[0]
        except Exception as exc:  # a failed job fails its rows, not the whole run
            first = str(exc).strip().splitlines()
            tail = [ln for ln in first if ln.strip()][-1:] or ["?"]
            for contender in runnable:
                rows[contender.name].update(status="failed", reason=f"{first[0]} ... {tail[0]}")
        else:
            ctx = Context(
                spec=spec,
                device=torch.device(raw["device"]),
                precision=args.precision,
                batch=args.batch,
            )
            assemble_rows(raw, plan, runnable, rows, ctx, args.peak_tflops)
        _log(f"{suite.name}/{model}: done in {time.perf_counter() - start:.1f} s")
    return list(rows.values())


def _models(suite: Suite, args: argparse.Namespace) -> list[str]:
    if args.quick and not args.model_given and suite.quick_models is not None:
        return [m for m in args.model if m in suite.quick_models]
    return list(args.model)


def _machine() -> dict[str, Any]:
    """Where and under what load the run happened (absolute times mean little without it)."""
    import platform

    import torch

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; returns the exit status (1 if any row failed)."""
    from benchmarks import report
    from benchmarks.results import add_ratios

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    suites = [get_suite(name) for name in args.suites]
    _prepare_parent(suites, args.model)
    from kolossos.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.name != "cpu" and args.world_size > accelerator.device_count():
        print(
            f"--world-size {args.world_size} needs as many {accelerator.name} devices; "
            f"{accelerator.device_count()} visible (KOLOSSOS_ACCELERATOR=cpu runs on gloo).",
            file=sys.stderr,
        )
        return 2
    machine_before = _machine()
    rows: list[dict[str, Any]] = []
    for suite in suites:
        python = _bench_python() if suite.needs else None
        if suite.needs and not importlib.util.find_spec(suite.needs) and python is not None:
            argv_rest = [a for a in argv if a != "--plot"]
            rows += _delegate(python, suite.name, argv_rest, _models(suite, args))
            continue
        models = _models(suite, args)
        suite_rows: list[dict[str, Any]] = []
        for model in models:
            suite_rows += _run_job(suite, model, args)
        counterparts = {n: c.counterpart for n, c in suite.contenders().items() if c.counterpart}
        for model in models:
            add_ratios(
                [r for r in suite_rows if r["model"] == model], suite.references, counterparts
            )
        rows += suite_rows
    if args.rows_out is not None:
        args.rows_out.write_text(json.dumps(rows, default=str))
        return 0
    references = {s.name: s.references for s in suites}
    print(report.format_table(rows, references))
    print(report.json_lines(rows), flush=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "runs" / "benchmarks" / f"{stamp}.json"
    meta = {
        "argv": argv,
        "command": "python -m benchmarks " + " ".join(argv),
        "date": stamp,
        "machine": machine_before,
        "loadavg_after": os.getloadavg(),
    }
    report.write_json(out, rows, meta)
    _log(f"results: {out}")
    if args.plot:
        try:
            report.write_plot(out.with_suffix(".png"), rows, references)
        except ImportError as exc:  # the results are saved; only the picture is missing
            _log(f"no plot: {exc}")
        else:
            _log(f"plot: {out.with_suffix('.png')}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0
