"""The largest GPT-2-style model one device trains: Gemini ``auto`` placement vs plain DDP, and
both against the memory limit of the machine.

Each attempt runs in a fresh process (``--attempt``) so that one attempt's allocations cannot
help or hurt the next; the driver tries the given layer counts for each mode and prints, per
attempt, whether two training steps completed, the parameter count, the optimizer data placed on
the device, the peak device allocation, the peak resident host memory and the step time, then the
largest model each mode trained (sizes are tried largest first, and a mode stops at the first that
trains), the ratio, and each largest model as a fraction of its mode's limit.

The limit (printed first, :func:`memory_limit`): DDP keeps 16 bytes per parameter on the device
(fp32 weights and gradients, Adam's two fp32 states; bf16 autocast, activations checkpointed),
so at most ``device memory / 16`` parameters; Gemini can spread the same 16 bytes (bf16 weights
and gradients, fp32 masters and Adam states) over device and host, so at most ``(device memory +
available host memory) / 16``. ``--auto`` picks the layer counts from it: DDP at 0.9 of its
limit, Gemini at each of ``--gemini-fractions`` of its own.

What the ``auto`` placement can reach of that (:func:`placement_bound`, printed with the limit):
with ``HybridAdam`` in bf16 a chunk's optimizer data on the host takes 14 bytes per parameter
(fp32 master 4, two Adam states 8, the bf16 gradient shard 2). It moves to the device only out
of the memory left when every chunk's bf16 working shard (2 bytes per parameter) is counted
resident there, within ``steady_cuda_cap_ratio`` (``s``, ``--steady-cap``) of the device, and
reserves the same 14 bytes per parameter there (these attempts do not accumulate gradients, so
no shard is widened to fp32). So ``14 X + 2 P <= s D`` (``X`` parameters stepped on the device)
and ``14 (P - X) <= H``, hence ``P <= (s D + H) / 16`` before activations and the gathered
chunks of a moment: with ``D`` = 139 GiB and ``H`` = 115 GiB, 0.95 of the limit at ``s`` = 0.9
and 0.97 at 0.95 (0.90 and 0.92 while a grant reserved 16 bytes per parameter, before
2026-11-29). Attempts run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (unless set), so
that the allocator's fragmentation does not eat the margin.

Both modes use bf16 and activation checkpointing. DDP: ``Booster(mixed_precision="bf16",
plugin=TorchDDPPlugin())``, model and Adam states on the device. Gemini: the model built inside
``LazyInitContext`` (no full-size copy ever exists on the host: the plugin fills its chunks one by
one), ``GeminiPlugin(placement_policy="auto", precision="bf16", chunk_init_device="cpu",
gpu_margin_mem_ratio=1.0)`` with ``HybridAdam``: chunks live on the host and visit the device
when needed; the optimizer data of as many chunks as the spare device memory holds is placed on
the device before the first step (its Adam states are created there), the rest is stepped on
the CPU. ``--device cpu`` runs the same code with gloo on the CPU (a smoke test: device and
host are then one memory).

NVMe (mode ``gemini-nvme``): the same Gemini run with ``HybridAdam(nvme_offload_fraction=f,
nvme_offload_dir=--nvme-dir)``. The streamed states (8 bytes per parameter) leave the host for
files: ``f`` is as much as 0.9 of the free disk under ``--nvme-dir`` holds, at most 1
(:func:`nvme_fraction`). Streamed chunks keep an fp32 gradient shard on the host (4 + 4 bytes per
parameter there), and their optimizer data is never granted device memory. The limit printed
beside it counts the disk as a third memory: ``(device + available host + free disk) / 16``.
``--auto`` tries this mode at ``--nvme-fractions`` of the Gemini limit *without* the disk
(default 1.05 and 1.0), sizes the plain Gemini attempts cannot reach.

Usage (one GPU)::

    python -m benchmarks.gemini_capacity --auto --hidden 4096 --heads 32 --modes gemini \
        --gemini-fractions 0.9 0.8
    python -m benchmarks.gemini_capacity --hidden 4096 --heads 32 --ddp-layers 16 20 \
        --gemini-layers 24 32
    python -m benchmarks.gemini_capacity --auto --modes gemini-nvme --nvme-dir /tmp/kolossos-nvme
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

VOCAB = 50257
MODES = ("ddp", "gemini", "gemini-nvme")
BYTES_PER_PARAM = 16
"""fp32 weights + gradients + two Adam states (DDP), or bf16 weights + gradients + fp32 masters +
two Adam states (Gemini)"""


def gpt2_params(layers: int, hidden: int, seq: int) -> int:
    """Parameters of a GPT-2 (tied head) with these sizes."""
    per_layer = 12 * hidden * hidden + 13 * hidden
    return layers * per_layer + (VOCAB + seq) * hidden + 2 * hidden


def layers_for(params: float, hidden: int, seq: int) -> int:
    """The most layers whose model stays within ``params`` parameters (at least 1)."""
    per_layer = 12 * hidden * hidden + 13 * hidden
    return max(1, math.floor((params - gpt2_params(0, hidden, seq)) / per_layer))


def host_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (what the host can still give without swapping)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def memory_limit(device: str, nvme_dir: str | None = None) -> dict[str, float]:
    """Device, available host and (with ``nvme_dir``) free disk bytes, and the largest
    parameter counts they allow (module doc)."""
    import torch

    host = host_available_bytes()
    if device == "cuda":
        device_bytes = torch.cuda.mem_get_info()[1]
    else:  # one memory: the "device" share is the host itself
        device_bytes, host = host, 0
    limit = {
        "device_gib": device_bytes / 2**30,
        "host_available_gib": host / 2**30,
        "bytes_per_param": BYTES_PER_PARAM,
        "ddp_limit_params": device_bytes / BYTES_PER_PARAM,
        "gemini_limit_params": (device_bytes + host) / BYTES_PER_PARAM,
    }
    if nvme_dir is not None:
        disk = disk_free_bytes(nvme_dir)
        limit["disk_free_gib"] = disk / 2**30
        limit["gemini-nvme_limit_params"] = (device_bytes + host + disk) / BYTES_PER_PARAM
    return limit


def disk_free_bytes(path: str) -> int:
    """Free bytes of the file system that holds ``path`` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    return shutil.disk_usage(path).free


def mount_type(path: str) -> str:
    """The type of the file system that holds ``path`` (``/proc/mounts``; ``""`` if unknown)."""
    path = os.path.realpath(path)
    best, fs_type = "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fs_type = point, fields[2]
    except OSError:
        return ""
    return fs_type


def nvme_fraction(params: int, disk_free: int) -> float:
    """The share of the optimizer states streamed to disk: as much as 0.9 of the free disk holds
    at 8 bytes (two fp32 Adam states) per parameter, at most all of them."""
    return min(1.0, 0.9 * disk_free / (8 * params))


def placement_bound(limit: dict[str, float], steady_cap: float) -> float:
    """The most parameters the ``auto`` placement can give Gemini on this machine (module doc),
    as a fraction of the Gemini limit."""
    device, host = limit["device_gib"], limit["host_available_gib"]
    return (steady_cap * device + host) / (device + host)


def _attempt(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from kolossos.booster import Booster
    from kolossos.booster.plugin import GeminiPlugin, TorchDDPPlugin
    from kolossos.lazy import LazyInitContext
    from kolossos.nn.optimizer import HybridAdam

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + args.layers))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    gemini = args.mode in ("gemini", "gemini-nvme")
    if gemini:
        with LazyInitContext():
            model = GPT2LMHeadModel(config)
    else:
        with torch.device(args.device):
            model = GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    params = sum(p.numel() for p in model.parameters())
    if gemini:
        plugin: Any = GeminiPlugin(
            placement_policy="auto",
            precision="bf16",
            chunk_init_device=torch.device("cpu"),
            hidden_dim=args.hidden,
            gpu_margin_mem_ratio=1.0,
            steady_cuda_cap_ratio=args.steady_cap,
        )
        booster = Booster(plugin=plugin)
    else:
        booster = Booster(mixed_precision="bf16", plugin=TorchDDPPlugin())
    boosted: Any
    optimizer: Any
    nvme = {}
    if args.mode == "gemini-nvme":
        fraction = nvme_fraction(params, disk_free_bytes(args.nvme_dir))
        nvme = {"nvme_offload_fraction": fraction, "nvme_offload_dir": args.nvme_dir}
    optim = HybridAdam(model.parameters(), lr=1e-4, **nvme)
    boosted, optimizer, *_ = booster.boost(model, optim)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        ids = torch.randint(0, VOCAB, (args.batch, args.seq), device=args.device)
        loss = boosted(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # optimizer data the auto placement put on the device (GeminiDDP's policy)
    on_device = boosted.policy.optim_reserved_bytes / 2**30 if gemini else None
    dist.destroy_process_group()
    return {
        "params": params,
        "optim_on_device_gib": on_device,
        "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_s": times[-1],
        "nvme_offload_fraction": nvme.get("nvme_offload_fraction"),
        "loss": float(loss),
    }


def _run_one(args: argparse.Namespace, mode: str, layers: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.gemini_capacity", "--attempt", "--mode", mode,
           "--layers", str(layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--seq", str(args.seq), "--batch", str(args.batch), "--device", args.device,
           "--steady-cap", str(args.steady_cap)]  # fmt: skip
    if args.nvme_dir is not None:
        cmd += ["--nvme-dir", args.nvme_dir]
    start = time.perf_counter()
    try:
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        out, code = proc.stdout, proc.returncode
        err = proc.stderr
    except subprocess.TimeoutExpired:
        out, code, err = "", -1, "timeout"
    row: dict[str, Any] = {"mode": mode, "layers": layers, "ok": False,
                           "wall_s": round(time.perf_counter() - start, 1)}  # fmt: skip
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if code == 0 and lines:
        row.update(json.loads(lines[-1]), ok=True)
    else:
        tail = err.strip().splitlines()[-1:] if err else []
        row["error"] = tail[0][:200] if tail else f"exit {code}"
    return row


def main(argv: list[str] | None = None) -> int:
    """Command line (module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempt", action="store_true", help="internal: one attempt")
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ddp-layers", type=int, nargs="*", default=[])
    parser.add_argument("--gemini-layers", type=int, nargs="*", default=[])
    parser.add_argument("--gemini-nvme-layers", type=int, nargs="*", default=[])
    parser.add_argument("--auto", action="store_true", help="layer counts from the limit")
    for flag, default, sizes in (
        ("--gemini-fractions", [0.8, 0.9], "Gemini's model sizes as fractions of its limit"),
        ("--nvme-fractions", [1.0, 1.05], "gemini-nvme's sizes, fractions of Gemini's limit"),
    ):
        parser.add_argument(flag, type=float, nargs="+", default=default, help=f"--auto: {sizes}")
    parser.add_argument("--nvme-dir", help="gemini-nvme: directory of the optimizer state files")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["ddp", "gemini"])
    parser.add_argument("--steady-cap", type=float, default=0.95,
                        help="Gemini's steady_cuda_cap_ratio")  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.steady_cap <= 1 or not all(f > 0 for f in args.gemini_fractions):
        parser.error(
            f"--steady-cap {args.steady_cap} must lie in (0, 1] and --gemini-fractions "
            f"{args.gemini_fractions} must be positive, e.g. --steady-cap 0.95"
        )
    if "gemini-nvme" in (*args.modes, args.mode):
        if args.nvme_dir is None:
            parser.error("--modes gemini-nvme needs --nvme-dir, a directory on the disk to use")
        fs_type = mount_type(args.nvme_dir)
        if fs_type in ("tmpfs", "ramfs"):
            parser.error(
                f"--nvme-dir {args.nvme_dir} is on {fs_type}, which is memory, not a disk; pick "
                "a directory on a disk file system"
            )
    if args.attempt:
        print(json.dumps(_attempt(args)), flush=True)
        return 0
    limit = memory_limit(args.device, args.nvme_dir if "gemini-nvme" in args.modes else None)
    bound = round(placement_bound(limit, args.steady_cap), 3)
    print(json.dumps({"limit": limit, "placement_bound": bound}), flush=True)
    if args.auto:
        ddp, gem = limit["ddp_limit_params"], limit["gemini_limit_params"]
        args.ddp_layers = [layers_for(0.9 * ddp, args.hidden, args.seq)]
        args.gemini_layers = [
            layers_for(f * gem, args.hidden, args.seq) for f in args.gemini_fractions
        ]
        args.gemini_nvme_layers = [
            layers_for(f * gem, args.hidden, args.seq) for f in args.nvme_fractions
        ]
    best: dict[str, int] = {}
    tries = zip(MODES, (args.ddp_layers, args.gemini_layers, args.gemini_nvme_layers), strict=True)
    for mode, layer_list in tries:
        if mode not in args.modes:
            continue
        for layers in sorted(layer_list, reverse=True):  # the largest first; stop once one trains
            row = _run_one(args, mode, layers)
            print(json.dumps(row), flush=True)
            if row["ok"]:
                best[mode] = int(row["params"])
                break
    summary: dict[str, Any] = {"largest_params": best}
    for mode, params in best.items():
        summary[f"{mode}_of_limit"] = round(params / limit[f"{mode}_limit_params"], 3)
    if "ddp" in best and "gemini" in best:
        summary["gemini_over_ddp"] = round(best["gemini"] / best["ddp"], 2)
    if "gemini-nvme" in best:  # how far the disk extends Gemini's limit without it
        summary["gemini-nvme_of_gemini_limit"] = round(
            best["gemini-nvme"] / limit["gemini_limit_params"], 3
        )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
