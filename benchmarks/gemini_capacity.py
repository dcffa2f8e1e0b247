"""The largest GPT-2-style model one GPU trains: Gemini ``auto`` placement vs plain DDP.

Each attempt runs in a fresh process (``--attempt``) so that one attempt's allocations cannot
help or hurt the next; the driver tries the given layer counts for each mode and prints, per
attempt, whether two training steps completed, the parameter count, the peak GPU allocation, the
peak resident host memory and the step time, then the largest model each mode trained and the
ratio. Both modes use bf16 and activation checkpointing. DDP: ``Booster(mixed_precision="bf16",
plugin=TorchDDPPlugin())``, model and AdamW states on the GPU. Gemini: ``GeminiPlugin(
placement_policy="auto", precision="bf16", chunk_init_device="cpu")`` with ``HybridAdam``: chunks
live on the host and visit the GPU when needed; master weights and Adam states of host chunks
are stepped on the CPU.

Usage (one GPU)::

    python -m benchmarks.gemini_capacity --hidden 4096 --heads 32 --ddp-layers 16 20 \
        --gemini-layers 24 32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any


def _attempt(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from kolossos.booster import Booster
    from kolossos.booster.plugin import GeminiPlugin, TorchDDPPlugin
    from kolossos.nn.optimizer import HybridAdam

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + args.layers))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    config = GPT2Config(
        vocab_size=50257, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    gemini = args.mode == "gemini"
    with torch.device("cpu" if gemini else "cuda"):
        model = GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    params = sum(p.numel() for p in model.parameters())
    if gemini:
        plugin: Any = GeminiPlugin(
            placement_policy="auto",
            precision="bf16",
            chunk_init_device=torch.device("cpu"),
            hidden_dim=args.hidden,
        )
        booster = Booster(plugin=plugin)
    else:
        booster = Booster(mixed_precision="bf16", plugin=TorchDDPPlugin())
    boosted: Any
    optimizer: Any
    boosted, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-4))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        ids = torch.randint(0, 50257, (args.batch, args.seq), device="cuda")
        loss = boosted(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {
        "params": params,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_s": times[-1],
        "loss": float(loss),
    }


def _run_one(args: argparse.Namespace, mode: str, layers: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.gemini_capacity", "--attempt", "--mode", mode,
           "--layers", str(layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--seq", str(args.seq), "--batch", str(args.batch)]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempt", action="store_true", help="internal: one attempt")
    parser.add_argument("--mode", choices=("ddp", "gemini"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ddp-layers", type=int, nargs="*", default=[])
    parser.add_argument("--gemini-layers", type=int, nargs="*", default=[])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=400.0)
    args = parser.parse_args(argv)
    if args.attempt:
        print(json.dumps(_attempt(args)), flush=True)
        return 0
    best: dict[str, int] = {}
    for mode, layer_list in (("ddp", args.ddp_layers), ("gemini", args.gemini_layers)):
        for layers in layer_list:
            row = _run_one(args, mode, layers)
            print(json.dumps(row), flush=True)
            if row["ok"]:
                best[mode] = max(best.get(mode, 0), int(row["params"]))
    if "ddp" in best and "gemini" in best:
        ratio = best["gemini"] / best["ddp"]
        print(json.dumps({"largest_params": best, "gemini_over_ddp": round(ratio, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
