"""Timing contenders A/B/A/B, in one of two granularities.

* ``step`` (default): every contender of the job is built once per repetition and kept alive;
  timed step ``j`` of every contender runs in turn (A, B, C, A, B, C, ...), each after a barrier,
  so a step of the row and of its baseline are seconds apart. On a shared machine whose load
  changes from second to second this pairing is what makes ratios reproducible. It costs memory:
  all contenders' model states are alive at once.
* ``rep``: each contender in turn builds a fresh copy, warms up and runs all its steps (A A A,
  B B B, ...); one contender in memory at a time.

Each timed step records its wall time and the process's CPU time (all threads: compute and the
communication backend's), after synchronising the accelerator.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.contenders import Contender, Context, Setup, train_step

__all__ = ["INTERLEAVE_MODES", "time_collective", "time_repetition"]

INTERLEAVE_MODES = ("step", "rep")
Batch = tuple[torch.Tensor, torch.Tensor]
Entry = dict[str, list[float]]


def time_collective(op: Callable[[], object], loops: int) -> tuple[float, float]:
    """Wall and process CPU seconds per call of ``op`` (a collective every rank runs), over
    ``loops`` calls between two barriers."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(loops):
        op()
    dist.barrier()
    return (time.perf_counter() - wall) / loops, (time.process_time() - cpu) / loops


def sync() -> None:
    """Wait for the accelerator's queued work (a no-op on the CPU)."""
    from kolossos.accelerator import get_accelerator

    get_accelerator().synchronize()


def cleanup() -> None:
    """Free what the last contender left behind."""
    from kolossos.accelerator import get_accelerator

    gc.collect()
    if get_accelerator().name != "cpu":
        get_accelerator().empty_cache()


def _participates(contender: Contender) -> bool:
    return not contender.single or dist.get_rank() == 0


def _build(contender: Contender, template: torch.nn.Module, ctx: Context) -> Setup:
    return contender.setup(copy.deepcopy(template).to(ctx.device), ctx)


def _timed_step(setup: Setup, batch: Batch, entry: Entry) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    train_step(setup, batch)
    sync()
    entry["wall"].append(time.perf_counter() - wall)
    entry["cpu"].append(time.process_time() - cpu)


def _by_repetition(
    contenders: list[Contender],
    template: torch.nn.Module,
    batches: list[Batch],
    warmup: int,
    ctx: Context,
) -> dict[str, Entry | None]:
    out: dict[str, Entry | None] = {}
    for contender in contenders:
        dist.barrier()
        entry: Entry | None = None
        if _participates(contender):
            setup = _build(contender, template, ctx)
            for batch in batches[:warmup]:
                train_step(setup, batch)
            sync()
            if not contender.single:
                dist.barrier()
            entry = {"wall": [], "cpu": []}
            for batch in batches[warmup:]:
                _timed_step(setup, batch, entry)
            setup.close()
            del setup
        cleanup()
        out[contender.name] = entry
    return out


def _by_step(
    contenders: list[Contender],
    template: torch.nn.Module,
    batches: list[Batch],
    warmup: int,
    ctx: Context,
) -> dict[str, Entry | None]:
    setups: dict[str, Setup] = {}
    for contender in contenders:
        dist.barrier()
        if _participates(contender):
            setups[contender.name] = _build(contender, template, ctx)
    for batch in batches[:warmup]:
        for contender in contenders:
            if contender.name in setups:
                train_step(setups[contender.name], batch)
    out: dict[str, Entry | None] = {
        c.name: ({"wall": [], "cpu": []} if c.name in setups else None) for c in contenders
    }
    for batch in batches[warmup:]:
        for contender in contenders:
            dist.barrier()  # every step starts with the ranks aligned; the wait is not timed
            entry = out[contender.name]
            if entry is not None:
                _timed_step(setups[contender.name], batch, entry)
    dist.barrier()
    for setup in setups.values():
        setup.close()
    setups.clear()
    cleanup()
    return out


def time_repetition(
    mode: str,
    contenders: list[Contender],
    template: torch.nn.Module,
    batches: list[Batch],
    warmup: int,
    ctx: Context,
) -> dict[str, Any]:
    """One repetition of every contender: ``{name: {"wall": [...], "cpu": [...]} or None}``
    (``None`` on a rank that sits the contender out, e.g. rank 1 for the one-process baseline).

    Raises:
        ValueError: an unknown mode.
    """
    if mode == "step":
        return _by_step(contenders, template, batches, warmup, ctx)
    if mode == "rep":
        return _by_repetition(contenders, template, batches, warmup, ctx)
    raise ValueError(f"interleave mode {mode!r} must be one of {INTERLEAVE_MODES}.")
