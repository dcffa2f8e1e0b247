"""Optimizer-step benchmark: kolossos CPUAdam vs torch AdamW (foreach, fused) vs DeepSpeedCPUAdam
on the same parameters (default 100 M fp32), in the same run, A/B/A/B, plus CPUAdam with full
NVMe offload. The update is memory-bound, so each row is also given as achieved bandwidth
(28 bytes per parameter: read p, g, m, v; write p, m, v) against the bandwidth of a large
``Tensor.copy_`` (8 bytes per element) and of an in-place ``mul_`` measured in the same run.

    .venv-bench/bin/python -m benchmarks.suites.optim [--numel 100e6] [--threads 1,2] [--reps 5]

Run with the project's ``.venv`` it re-executes itself under ``.venv-bench`` (DeepSpeed, from
``bash benchmarks/setup_deepspeed.sh``) when that exists. DeepSpeedCPUAdam JIT-compiles its C++
op on first use (~3.5-6 min here, cached in ~/.cache/torch_extensions); kolossos needs no build.
Not a registered suite of ``python -m benchmarks`` (that runner trains models on several ranks).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
BYTES_PER_PARAM = 28  # fp32 AdamW: 4 reads + 3 writes of 4 bytes
Step = Callable[[], Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suites.optim", description=__doc__)
    p.add_argument("--numel", type=float, default=100e6, help="parameters (default 100e6)")
    p.add_argument("--tensors", type=int, default=50, help="split into this many tensors")
    p.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="comma list")
    p.add_argument("--reps", type=int, default=5, help="A/B/A/B repetitions")
    p.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="NVMe offload directory")
    p.add_argument("--skip", default="", help="comma list of contenders to leave out")
    p.add_argument("--out", type=Path, help="JSON file (default runs/benchmarks/optim-<time>.json)")
    p.add_argument(
        "--gpt2-steps",
        type=int,
        default=0,
        help="also time N GPT-2 small training steps (batch 4 x 128) per optimizer, A/B: "
        "HybridAdam resident vs nvme_offload_fraction=1.0 (0: skip)",
    )
    return p.parse_args(argv)


def _maybe_reexec(argv: list[str]) -> None:
    bench = ROOT / ".venv-bench" / "bin" / "python"
    here = Path(sys.prefix).resolve() == bench.parent.parent.resolve()
    if importlib.util.find_spec("deepspeed") is None and bench.exists() and not here:
        print(f"[optim] deepspeed missing here: re-running under {bench}", file=sys.stderr)
        os.execv(bench, [str(bench), "-m", "benchmarks.suites.optim", *argv])


def _contenders(params: list[torch.nn.Parameter], args: argparse.Namespace) -> dict[str, Any]:
    """name -> optimizer (all AdamW, lr 1e-3, weight decay 0.01, on the same parameters)."""
    from kolossos.nn.optimizer import CPUAdam

    hp: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.01}
    skip = set(filter(None, args.skip.split(",")))
    out: dict[str, Any] = {}
    makers: dict[str, Callable[[], Any]] = {
        "torch-adamw-foreach": lambda: torch.optim.AdamW(params, foreach=True, **hp),
        "torch-adamw-fused": lambda: torch.optim.AdamW(params, fused=True, **hp),
        "kolossos-cpuadam": lambda: CPUAdam(params, **hp),
        "deepspeed-cpuadam": lambda: _deepspeed(params, hp),
        "kolossos-cpuadam-nvme": lambda: CPUAdam(
            params, nvme_offload_fraction=1.0, nvme_offload_dir=args.nvme_dir, **hp
        ),
    }
    for name, make in makers.items():
        if name in skip:
            continue
        try:
            out[name] = make()
        except Exception as exc:  # a missing baseline is reported, not fatal
            print(f"[optim] {name} unavailable: {exc}", file=sys.stderr)
    return out


def _deepspeed(params: list[torch.nn.Parameter], hp: dict[str, Any]) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    t = time.perf_counter()
    opt = DeepSpeedCPUAdam(params, adamw_mode=True, **hp)
    print(f"[optim] DeepSpeedCPUAdam ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return opt


def _timed(fn: Step, repeat: int) -> float:
    """Mean seconds per call over ``repeat`` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _bandwidth(numel: int) -> tuple[float, float]:
    """Seconds of one ``dst.copy_(src)`` and of one in-place ``dst.mul_(1.0)`` on ``numel`` fp32
    elements (buffers allocated here and freed after, to keep the peak memory down)."""
    src, dst = torch.ones(numel), torch.zeros(numel)
    dst.copy_(src)  # touch every page first
    return _timed(lambda: dst.copy_(src), 3), _timed(lambda: dst.mul_(1.0), 3)


def _step_of(opt: Any) -> Step:
    flush = getattr(opt, "flush", None)
    if flush is None:
        return opt.step

    def step() -> None:  # count the offloaded states' writes in the step that issued them
        opt.step()
        flush()

    return step


def run(args: argparse.Namespace) -> dict[str, Any]:
    numel = int(args.numel)
    torch.manual_seed(0)
    sizes = [numel // args.tensors] * args.tensors
    sizes[-1] += numel - sum(sizes)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p).mul_(1e-3)
    optimizers = _contenders(params, args)
    steps = {name: _step_of(opt) for name, opt in optimizers.items()}
    threads = [int(t) for t in args.threads.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    for t in threads:
        torch.set_num_threads(t)
        for fn in steps.values():
            fn()  # warm-up: states allocated, pages touched
        for rep in range(args.reps):
            order = list(steps.items())
            order = order if rep % 2 == 0 else order[::-1]  # A/B then B/A
            copy_s, inplace_s = _bandwidth(numel)
            times.setdefault(("copy", t), []).append(copy_s)
            times.setdefault(("inplace", t), []).append(inplace_s)
            for name, fn in order:
                times.setdefault((name, t), []).append(_timed(fn, args.steps))
            print(f"[optim] threads {t} rep {rep + 1}/{args.reps} done", file=sys.stderr)
    for opt in optimizers.values():
        if hasattr(opt, "close"):
            opt.close()
    return {"numel": numel, "threads": threads, "times": times, "contenders": list(steps)}


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    numel, out = result["numel"], []
    for t in result["threads"]:
        med = {k[0]: statistics.median(v) for k, v in result["times"].items() if k[1] == t}
        copy_bw, inplace_bw = 8 * numel / med["copy"], 8 * numel / med["inplace"]
        for name in result["contenders"]:
            sec = med[name]
            row = {
                "contender": name,
                "threads": t,
                "median_ms": 1e3 * sec,
                "min_ms": 1e3 * min(result["times"][(name, t)]),
                "gb_s": BYTES_PER_PARAM * numel / sec / 1e9,
                "copy_gb_s": copy_bw / 1e9,
                "inplace_gb_s": inplace_bw / 1e9,
                "pct_copy": 100 * BYTES_PER_PARAM * numel / sec / copy_bw,
                "pct_inplace": 100 * BYTES_PER_PARAM * numel / sec / inplace_bw,
            }
            for ref in ("torch-adamw-fused", "torch-adamw-foreach", "deepspeed-cpuadam"):
                if ref in med:
                    row[f"speedup_vs_{ref}"] = med[ref] / sec
            if name == "kolossos-cpuadam-nvme" and "kolossos-cpuadam" in med:
                row["slowdown_vs_resident"] = sec / med["kolossos-cpuadam"]
            out.append(row)
    return out


def format_table(table: list[dict[str, Any]]) -> str:
    head = (
        f"{'contender':24} {'thr':>3} {'ms/step':>8} {'min':>7} {'GB/s':>6} {'%copy':>6} "
        f"{'%inpl':>6} {'x fused':>7} {'x fore':>7} {'x DS':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in table:
        ratios = [r.get(f"speedup_vs_{k}") for k in ("torch-adamw-fused", "torch-adamw-foreach")]
        ratios.append(r.get("speedup_vs_deepspeed-cpuadam"))
        shown = " ".join(f"{x:7.2f}" if x else f"{'-':>7}" for x in ratios)
        lines.append(
            f"{r['contender']:24} {r['threads']:3d} {r['median_ms']:8.1f} {r['min_ms']:7.1f} "
            f"{r['gb_s']:6.2f} {r['pct_copy']:6.0f} {r['pct_inplace']:6.0f} {shown}"
        )
    t0 = table[0] if table else {}
    lines.append(
        f"copy_ bandwidth {t0.get('copy_gb_s', 0):.2f} GB/s, in-place mul_ "
        f"{t0.get('inplace_gb_s', 0):.2f} GB/s (first thread count; 8 bytes per element)"
    )
    return "\n".join(lines)


def gpt2_training(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per GPT-2 small training step (forward, backward, step), resident vs offloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kolossos.nn.optimizer import HybridAdam

    torch.manual_seed(0)
    models = {"resident": GPT2LMHeadModel(GPT2Config())}
    models["nvme"] = GPT2LMHeadModel(GPT2Config())
    models["nvme"].load_state_dict(models["resident"].state_dict())
    opts = {
        "resident": HybridAdam(models["resident"].parameters()),
        "nvme": HybridAdam(
            models["nvme"].parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=args.nvme_dir
        ),
    }
    ids = torch.randint(50257, (4, 128), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"resident": [], "nvme": []}
    for i in range(args.gpt2_steps + 1):
        for name in times if i % 2 == 0 else list(times)[::-1]:
            start = time.perf_counter()
            models[name](input_ids=ids, labels=ids).loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            getattr(opts[name], "flush")()  # noqa: B009 (the writes count in this step)
            if i > 0:  # the first step allocates the states
                times[name].append(time.perf_counter() - start)
    opts["nvme"].close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"gpt2_step_s": med, "gpt2_nvme_slowdown": med["nvme"] / med["resident"]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _maybe_reexec(argv)
    args = parse_args(argv)
    result = run(args)
    table = rows(result)
    print(format_table(table))
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta: dict[str, Any] = {
        "suite": "optim",
        "date": stamp,
        "command": "python -m benchmarks.suites.optim " + " ".join(argv),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
    if args.gpt2_steps:
        meta.update(gpt2_training(args))
        print(
            f"GPT-2 small training step (threads {torch.get_num_threads()}): "
            f"resident {meta['gpt2_step_s']['resident']:.2f} s, full NVMe offload "
            f"{meta['gpt2_step_s']['nvme']:.2f} s: x{meta['gpt2_nvme_slowdown']:.2f}"
        )
    print(json.dumps({**meta, "rows": table}))
    out = args.out or ROOT / "runs" / "benchmarks" / f"optim-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = {f"{k[0]}@{k[1]}": v for k, v in result["times"].items()}
    out.write_text(json.dumps({**meta, "rows": table, "raw_seconds": raw}, indent=1))
    print(f"[optim] results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
