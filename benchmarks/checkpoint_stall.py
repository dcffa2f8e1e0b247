"""How long a checkpoint stops training: kolossos synchronous and asynchronous saves side by side
with torch.distributed.checkpoint's ``save`` and ``async_save``, on the same model and ranks.

Each rank trains a GPT-2 under ``TorchDDPPlugin`` (AdamW states present) and, in alternating
order per repetition, checkpoints model and optimizer with each contender into a fresh folder.
The *stall* is the time from the call until training can continue (for the asynchronous ones,
until the call returns); the *complete* time is until the files are on disk on every rank (one
training step runs in between). DCP runs on a gloo group of its own, which its ``async_save``
needs: its background thread plans with collectives. The
median over repetitions is printed per contender with the ratio to kolossos' synchronous save,
then one JSON line.

Usage (2 ranks on CPU)::

    torchrun --nproc_per_node 2 -m benchmarks.checkpoint_stall --model gpt2-50m --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import kolossos
from benchmarks.models import get_model
from kolossos.booster import Booster
from kolossos.booster.plugin import TorchDDPPlugin

Saver = Callable[[Path], Callable[[], None]]  # starts a save; returns "wait until on disk"


def _train_step(booster: Booster, model: Any, opt: Any, criterion: Any, batch: Any) -> None:
    inputs, targets = batch
    booster.backward(criterion(model(inputs), targets), opt)
    opt.step()
    opt.zero_grad()


def _savers(booster: Booster, model: Any, opt: Any) -> dict[str, Saver]:
    def kolossos_sync(folder: Path) -> Callable[[], None]:
        booster.save_model(model, str(folder / "model"), shard=True, use_safetensors=True)
        booster.save_optimizer(opt, str(folder / "optimizer"), shard=True)
        return lambda: None

    def kolossos_async(folder: Path) -> Callable[[], None]:
        booster.save_model(
            model, str(folder / "model"), shard=True, use_safetensors=True, use_async=True
        )
        booster.save_optimizer(opt, str(folder / "optimizer"), shard=True, use_async=True)
        return booster.wait_async_saves  # local; the caller's barrier makes it every rank's

    def state() -> dict[str, Any]:
        return {"model": model.unwrap().state_dict(), "optim": opt.unwrap().state_dict()}

    # DCP's async_save plans with collectives on its background thread: it needs a process
    # group of its own (on the default one it deadlocks against DDP's all-reduces)
    group = dist.new_group(backend="gloo")

    def dcp_sync(folder: Path) -> Callable[[], None]:
        dcp.save(state(), checkpoint_id=str(folder), process_group=group)
        return lambda: None

    def dcp_async(folder: Path) -> Callable[[], None]:
        future: Any = dcp.async_save(state(), checkpoint_id=str(folder), process_group=group)
        return lambda: future.result()

    return {
        "kolossos sync": kolossos_sync,
        "kolossos async": kolossos_async,
        "dcp save": dcp_sync,
        "dcp async_save": dcp_async,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-50m")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    kolossos.launch_from_torch(config={}, verbose=False)
    rank = dist.get_rank()
    spec = get_model(args.model)
    torch.manual_seed(0)
    booster = Booster(plugin=TorchDDPPlugin())
    model = spec.build()
    model, opt, criterion, *_ = booster.boost(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), spec.loss
    )
    batch = spec.make_batch(torch.Generator().manual_seed(rank), args.batch)
    step = lambda: _train_step(booster, model, opt, criterion, batch)  # noqa: E731
    step()  # optimizer states exist
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_stall_"))
    savers = _savers(booster, model, opt)
    stall: dict[str, list[float]] = {name: [] for name in savers}
    complete: dict[str, list[float]] = {name: [] for name in savers}
    for rep in range(args.reps):
        order = list(savers) if rep % 2 == 0 else list(reversed(savers))
        for name in order:
            folder = root / f"{name.replace(' ', '_')}_{rep}"
            dist.barrier()
            began = time.perf_counter()
            wait = savers[name](folder)
            returned = time.perf_counter()
            step()  # training goes on meanwhile
            wait()
            dist.barrier()
            done = time.perf_counter()
            stall[name].append(returned - began)
            complete[name].append(done - began)
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    if rank == 0:
        base = statistics.median(stall["kolossos sync"])
        print(f"model {args.model}, {dist.get_world_size()} ranks, {args.reps} reps (median s)")
        print(f"{'contender':<16} {'stall':>8} {'complete':>9} {'stall vs kolossos sync':>24}")
        row = {}
        for name in savers:
            s, c = statistics.median(stall[name]), statistics.median(complete[name])
            row[name] = {"stall_s": s, "complete_s": c}
            print(f"{name:<16} {s:8.3f} {c:9.3f} {s / base:23.2f}x")
        print(json.dumps({"benchmark": "checkpoint_stall", "model": args.model, **row}))
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
