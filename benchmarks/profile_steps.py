"""Where a training step's time goes, per row of a suite: ``python -m benchmarks profile``.

Each rank builds one row at a time (a fresh copy of the same seeded model, the row's own setup
from its suite), runs the warm-up steps, then profiles the timed steps with ``torch.profiler``
(CPU activities, main thread) and splits each step's wall time into:

* ``fwd`` / ``bwd``: operator time of the forward / backward phase that is neither
  communication nor a copy (the model's compute, plus autograd's own accumulation);
* ``comm``: time the main thread spent inside collective calls and their waits
  (``c10d::*``, ``gloo:*``, ``record_param_comms``, ``wait``): communication not hidden behind
  compute, since gloo works on its own threads;
* ``optim``: the wrapped ``torch.optim`` step (the profiler's ``Optimizer.step#...`` range),
  whatever it contains;
* ``copy``: flatten / unflatten, dtype casts, bucket staging and zeroing outside the optimizer
  (``aten::copy_``, ``cat``, ``_to_copy``, ``zero_``, ``fill_``, ...);
* ``other``: the rest of the wall time, on no operator: Python (hooks, per-bucket and per-chunk
  bookkeeping), the interpreter, and waits the profiler does not see.

Beside them (``getrusage``, Linux): the process's CPU seconds over all its threads (``proc CPU``,
gloo's included), the part of it spent in the kernel (``sys``: page faults of fresh memory,
loopback TCP copies) and the main thread's minor page faults (``faults``, thousands).

Rows run one after another (not interleaved), so on a loaded machine compare categories within a
row rather than absolute times between rows; ``--repeat`` alternates the rows that many times
and reports the median per category.

Example (``.venv-bench`` for the DeepSpeed rows)::

    DS_ACCELERATOR=cpu .venv-bench/bin/python -m benchmarks profile --model gpt2-50m \\
        --rows kolossos-zero1,deepspeed-zero1 --steps 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CATEGORIES", "classify", "main"]

CATEGORIES = ("fwd", "bwd", "comm", "optim", "copy", "other")

_COMM_KEYS = (
    "c10d",
    "gloo",
    "nccl",
    "record_param_comms",
    "wait",
    "barrier",
    "broadcast",
    "all_reduce",
    "allreduce",
    "reduce_scatter",
    "all_gather",
    "allgather",
    "send",
    "recv",
)
_COPY_OPS = {
    "aten::copy_",
    "aten::cat",
    "aten::_to_copy",
    "aten::to",
    "aten::zero_",
    "aten::zeros",
    "aten::zeros_like",
    "aten::fill_",
    "aten::clone",
    "aten::contiguous",
    "aten::narrow_copy",
    "aten::empty",
    "aten::empty_like",
    "aten::set_",
    "aten::flatten_dense_tensors",
    "aten::unflatten_dense_tensors",
    "aten::split_with_sizes_copy",
    "aten::_foreach_copy_",
    "aten::_foreach_zero_",
}


def classify(name: str) -> str | None:
    """The category an operator's self time goes to, ignoring the phase (``None``: compute)."""
    low = name.lower()
    if name.startswith("Optimizer.step#"):
        return "optim"
    if any(key in low for key in _COMM_KEYS):
        return "comm"
    if name in _COPY_OPS:
        return "copy"
    return None


#: (category, operator) -> self seconds, when ``--top`` asks for the heaviest operators
_TOP: dict[tuple[str, str], float] | None = None


def _time_waits() -> None:
    """Make ``Work.wait()`` called from Python a profiler range (``comm::wait``): blocking on a
    collective otherwise shows on no operator. Profiling only; the rank process exits after."""
    work = torch._C._distributed_c10d.Work
    if getattr(work.wait, "_timed", False):
        return
    original = work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function("comm::wait"):
            return original(self, *args, **kwargs)

    wait._timed = True  # type: ignore[attr-defined]
    work.wait = wait  # type: ignore[method-assign]


def _split(events: Any) -> dict[str, float]:
    """Seconds per category for one step: self time of the operators under the ``phase::*``
    ranges, each counted in the outermost category that claims it (an optimizer range claims
    everything under it)."""
    out: dict[str, float] = defaultdict(float)

    def walk(event: Any, phase: str, inherited: str | None) -> None:
        own = inherited or classify(event.name)
        if own is None:  # compute; in step(): the gathers' glue and casts
            own = {"fwd": "fwd", "bwd": "bwd"}.get(phase, "copy")
        out[own] += event.self_cpu_time_total / 1e6
        if _TOP is not None:
            _TOP[(own, event.name)] += event.self_cpu_time_total / 1e6
        out["_covered"] += event.self_cpu_time_total / 1e6
        for child in event.cpu_children:
            walk(child, phase, own if own in ("optim", "comm") else inherited)

    for root in events:
        if root.cpu_parent is None and root.name.startswith("phase::"):
            phase = root.name.removeprefix("phase::")
            for child in root.cpu_children:
                walk(child, phase, None)
    return out


def _usage() -> tuple[Any, Any]:
    """``getrusage`` of the calling thread and of the whole process."""
    return resource.getrusage(resource.RUSAGE_THREAD), resource.getrusage(resource.RUSAGE_SELF)


def _cpu(usage: Any) -> float:
    return float(usage.ru_utime + usage.ru_stime)


def _profile_row(setup: Any, batches: list[Any]) -> list[dict[str, float]]:
    """Profile ``len(batches)`` steps of one built row; seconds per category per step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.timing import sync

    steps: list[dict[str, float]] = []
    for batch in batches:
        dist.barrier()
        thread0, proc0 = _usage()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0, c0 = time.perf_counter(), time.thread_time()
            with record_function("phase::fwd"):
                loss = setup.forward_loss(*batch)
            t1 = time.perf_counter()
            with record_function("phase::bwd"):
                setup.backward(loss)
                del loss
            t2 = time.perf_counter()
            with record_function("phase::step"):
                setup.step()
                setup.zero_grad()
                sync()
            t3, c3 = time.perf_counter(), time.thread_time()
        thread3, proc3 = _usage()
        split = _split(prof.events())
        wall = t3 - t0
        result = {k: split.get(k, 0.0) for k in CATEGORIES if k != "other"}
        result["other"] = max(0.0, wall - split["_covered"])
        result["wall"], result["cpu"] = wall, c3 - c0
        result["phase_fwd"], result["phase_bwd"], result["phase_step"] = t1 - t0, t2 - t1, t3 - t2
        result["proc_cpu"] = _cpu(proc3) - _cpu(proc0)
        result["proc_sys"] = proc3.ru_stime - proc0.ru_stime
        result["faults"] = float(thread3.ru_minflt - thread0.ru_minflt)
        steps.append(result)
    return steps


def rank_main(rank: int, world_size: int, port: int, args: dict[str, Any]) -> Any:
    """One rank: every row ``args["repeat"]`` times in turn; rank 0 returns the medians."""
    import kolossos
    from benchmarks.contenders import Context, train_step
    from benchmarks.models import get_model
    from benchmarks.suites import get_suite
    from benchmarks.timing import cleanup
    from kolossos.accelerator import get_accelerator

    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    verbose=False)  # fmt: skip
    torch.set_num_threads(args["threads"])
    _time_waits()
    spec = get_model(args["model"])
    device = get_accelerator().get_current_device()
    ctx = Context(spec=spec, device=device, precision=args["precision"], batch=args["batch"])
    available = get_suite(args["suite"]).contenders()
    torch.manual_seed(1234)
    template = spec.build()
    gen = torch.Generator().manual_seed(1234 + 7919 * rank)
    batches = []
    for _ in range(args["warmup"] + args["steps"]):
        inputs, targets = spec.make_batch(gen, args["batch"])
        batches.append((inputs.to(device), targets.to(device)))
    per_row: dict[str, list[dict[str, float]]] = defaultdict(list)
    tops: dict[str, list[tuple[float, str, str]]] = {}
    global _TOP
    for _ in range(args["repeat"]):
        for name in args["rows"]:
            dist.barrier()
            setup = available[name].setup(copy.deepcopy(template).to(device), ctx)
            for batch in batches[: args["warmup"]]:
                train_step(setup, batch)
            _TOP = defaultdict(float) if args["top"] else None
            per_row[name] += _profile_row(setup, batches[args["warmup"] :])
            if _TOP is not None:
                heavy = sorted(((s, c, op) for (c, op), s in _TOP.items()), reverse=True)
                tops[name] = heavy[: args["top"]]
            setup.close()
            del setup
            cleanup()
    summary = {
        name: {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        for name, steps in per_row.items()
    }
    if rank == 0:
        for name, heavy in tops.items():
            steps = args["steps"] * args["repeat"]
            ops = ", ".join(f"{c}:{op} {s / steps * 1e3:.1f}" for s, c, op in heavy)
            print(f"[profile] {name} rank 0, ms/step: {ops}", file=sys.stderr)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, summary)
    return gathered if rank == 0 else None


def format_table(per_rank: list[dict[str, dict[str, float]]], rows: list[str]) -> str:
    """Markdown: ms per step and category, the mean over ranks of each rank's median."""
    head = "| row | wall | main-thread CPU | " + " | ".join(CATEGORIES) + " | fwd / bwd / step "
    head += "| proc CPU | sys | faults (k) |"
    lines = [head, "|---" * (len(CATEGORIES) + 7) + "|"]
    for name in rows:
        mean = {k: statistics.mean(r[name][k] for r in per_rank) * 1e3 for k in per_rank[0][name]}
        cells = " | ".join(f"{mean[k]:.0f}" for k in CATEGORIES)
        phases = f"{mean['phase_fwd']:.0f} / {mean['phase_bwd']:.0f} / {mean['phase_step']:.0f}"
        usage = f"{mean['proc_cpu']:.0f} | {mean['proc_sys']:.0f} | {mean['faults'] / 1e6:.0f}"
        lines.append(
            f"| {name} | {mean['wall']:.0f} | {mean['cpu']:.0f} | {cells} | {phases} | {usage} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line (module doc)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--suite", default="deepspeed")
    p.add_argument("--rows", default="kolossos-zero1,kolossos-zero2,kolossos-gemini,"
                   "deepspeed-zero1,deepspeed-zero2,deepspeed-zero3,fsdp2")  # fmt: skip
    p.add_argument("--model", default="gpt2-50m")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=0, help="per rank (default: cores / ranks)")
    p.add_argument("--top", type=int, default=0, help="print rank 0's N heaviest operators")
    p.add_argument("--out", type=Path, help="write the per-rank medians (seconds) as JSON")
    args = p.parse_args(argv)
    from benchmarks.suites import get_suite
    from kolossos.testing import spawn

    rows = [r for r in args.rows.split(",") if r]
    available = get_suite(args.suite).contenders()
    unknown = [r for r in rows if r not in available]
    if unknown:
        p.error(f"--rows {unknown} not in suite {args.suite!r}; choose from {sorted(available)}")
    missing = {r: available[r].unavailable() for r in rows}
    for row, reason in missing.items():
        if reason:
            print(f"[profile] skipping {row}: {reason}", file=sys.stderr)
    rows = [r for r in rows if not missing[r]]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    options = {**vars(args), "rows": rows, "threads": threads, "out": None}
    per_rank = spawn(rank_main, args.world_size, timeout=3600, args=options)[0]
    print(format_table(per_rank, rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": options, "per_rank": per_rank}, indent=1))
    return 0
