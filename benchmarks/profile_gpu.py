"""Where a GPU training step's time goes, per row of a suite, by CUDA kernel class:
``python -m benchmarks.profile_gpu``.

One process, one GPU (a single-rank NCCL group). Each row trains a fresh copy of the same seeded
model: warm-up steps, then ``--steps`` steps under ``torch.profiler`` with CUDA activities. The
kernels' GPU time is summed by class — ``gemm`` (cuBLAS / CUTLASS matrix products), ``attention``
(flash / memory-efficient SDPA kernels), ``optimizer`` (Adam and the master-weight copies it
runs), ``norm`` (layer/RMS norm), ``loss`` (softmax / cross-entropy), ``elementwise`` (the rest),
``memcpy`` (copies and memsets) — and ``idle`` is the step's wall time no kernel ran. Prints a
table in ms per step and the heaviest kernels.

Example (one GPU)::

    python -m benchmarks.profile_gpu --suite gpu --model gpt2-1b --batch 16 \\
        --rows kolossos-hybrid,fsdp2 --steps 3
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

__all__ = ["KERNEL_CLASSES", "classify_kernel", "kernel_times", "main"]

#: kernel class -> substrings of the (lower-cased) kernel name, first match wins
KERNEL_CLASSES: dict[str, tuple[str, ...]] = {
    "attention": ("flash", "fmha", "attention", "sdpa"),
    "gemm": ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "cublas"),
    "optimizer": ("adam", "fused_optim"),
    "norm": ("layer_norm", "layernorm", "rms_norm"),
    "loss": ("softmax", "nll_loss", "cross_entropy", "log_softmax"),
}


def classify_kernel(name: str) -> str:
    """The class of a CUDA kernel by its name (:data:`KERNEL_CLASSES`, else ``elementwise``)."""
    lower = name.lower()
    for cls, keys in KERNEL_CLASSES.items():
        if any(key in lower for key in keys):
            return cls
    return "elementwise"


def _profile(setup: Any, batches: list[Any]) -> tuple[float, dict[str, float], dict[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.contenders import train_step

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for batch in batches:
            train_step(setup, batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:  # the trace's kernel records: a public format
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    return (wall, *kernel_times(events))


def kernel_times(events: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of GPU time by kernel class and by kernel name, from Chrome-trace events
    (``torch.profiler``'s export: complete events of category ``kernel``, ``gpu_memcpy`` or
    ``gpu_memset``, durations in microseconds)."""
    by_class: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    for event in events:
        cat = str(event.get("cat", "")).lower()
        if event.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name = str(event.get("name", ""))
        seconds = float(event.get("dur", 0.0)) / 1e6  # microseconds
        by_class["memcpy" if cat != "kernel" else classify_kernel(name)] += seconds
        by_kernel[name] += seconds
    return by_class, by_kernel


def main(argv: list[str] | None = None) -> int:
    """Command line (module doc)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="gpu")
    p.add_argument("--rows", default="kolossos-hybrid,fsdp2")
    p.add_argument("--model", default="gpt2-1b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--top", type=int, default=8, help="heaviest kernels printed per row")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    import kolossos
    from benchmarks.contenders import Context, train_step
    from benchmarks.models import get_model
    from benchmarks.suites import get_suite
    from benchmarks.timing import cleanup
    from kolossos.testing import free_port

    warnings.simplefilter("ignore", FutureWarning)
    kolossos.launch(config={}, rank=0, world_size=1, host="127.0.0.1", port=free_port(),
                    verbose=False)  # fmt: skip
    spec = get_model(args.model)
    device = torch.device("cuda", torch.cuda.current_device())
    ctx = Context(spec=spec, device=device, precision=args.precision, batch=args.batch)
    available = get_suite(args.suite).contenders()
    torch.manual_seed(1234)
    template = spec.build()
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(args.warmup + args.steps):
        inputs, targets = spec.make_batch(gen, args.batch)
        batches.append((inputs.to(device), targets.to(device)))
    classes = (*KERNEL_CLASSES, "elementwise", "memcpy")
    print("| row | wall | " + " | ".join(classes) + " | idle |  (ms per step)")
    print("|---" * (len(classes) + 3) + "|")
    for name in args.rows.split(","):
        setup = available[name].setup(copy.deepcopy(template).to(device), ctx)
        for batch in batches[: args.warmup]:
            train_step(setup, batch)
        wall, by_class, by_kernel = _profile(setup, batches[args.warmup :])
        n = args.steps
        busy = sum(by_class.values())
        cells = " | ".join(f"{by_class.get(c, 0.0) / n * 1e3:.1f}" for c in classes)
        print(f"| {name} | {wall / n * 1e3:.1f} | {cells} | {(wall - busy) / n * 1e3:.1f} |")
        heavy = sorted(by_kernel.items(), key=lambda kv: -kv[1])[: args.top]
        for kernel, seconds in heavy:
            print(f"    {seconds / n * 1e3:7.2f} ms  {classify_kernel(kernel):11s} {kernel[:110]}")
        setup.close()
        del setup
        cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
