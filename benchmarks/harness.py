"""What each rank of a benchmark job does: time every contender A/B/A/B, then account for it.

One job = one suite × one model on ``world_size`` ranks in one process group. Every repetition
builds each contender from a fresh copy of the same seeded model and runs it on the same
pre-generated batches, interleaved step by step or repetition by repetition
(:mod:`benchmarks.timing`). After the timed repetitions, one accounting pass per contender
measures memory (:class:`MemoryMeter`) and traffic (:class:`CommCounter`, :class:`WireMeter`)
with the instruments on, which would distort the timings.
"""

from __future__ import annotations

import copy
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.contenders import Contender, Context, Setup, train_step
from benchmarks.models import get_model
from benchmarks.timing import cleanup, sync, time_repetition
from kolossos.utils.profiling import CommCounter, WireMeter
from kolossos.utils.profiling.memory import MemoryMeter, gather_from_ranks

__all__ = ["JobPlan", "rank_main"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class JobPlan:
    """Everything a rank needs to run one job (picklable)."""

    suite: str
    model: str
    contenders: tuple[str, ...]
    """names, in the A/B order; all available"""
    batch: int
    """samples per rank and step"""
    steps: int
    warmup: int
    reps: int
    precision: str
    threads: int
    interleave: str = "step"
    """``step`` or ``rep`` (:mod:`benchmarks.timing`)"""
    account_steps: int = 2
    seed: int = 1234
    timeout: float = 1800.0


def _account(
    contender: Contender,
    template: torch.nn.Module,
    batches: list[Batch],
    plan: JobPlan,
    ctx: Context,
) -> dict[str, Any] | None:
    """Memory and traffic of one contender, instruments on."""
    dist.barrier()
    if contender.single and dist.get_rank() != 0:
        return None
    with MemoryMeter(ctx.device) as meter:
        model = copy.deepcopy(template).to(ctx.device)
        meter.track(model)
        setup: Setup | None = contender.setup(model, ctx)
        assert setup is not None
        del model
        meter.track(*setup.track)
        for category, objects in setup.track_as.items():
            meter.tracker.track(*objects, category=category)
        meter.reset_peak()  # the peak of training, not of wrapping
        train_step(setup, batches[0], meter.mark_model_states)
        n = plan.account_steps
        with CommCounter() as comm, WireMeter() as wire:
            for batch in batches[1 : 1 + n]:
                train_step(setup, batch, meter.mark_model_states)
            sync()
        setup.close()
        setup = None
    cleanup()
    memory = meter.result()
    gloo = dist.get_backend() == "gloo"
    return {
        "memory": memory.as_dict(),
        "comm_per_step": {
            "bytes": comm.bytes() / n,
            "sent_bytes": comm.sent_bytes() / n,
            # socket writes are gloo's traffic; NCCL's never pass through them
            "wire_bytes": None if wire.bytes is None or not gloo else wire.bytes / n,
            "calls": comm.calls() / n,
            "by_group": {
                group: {
                    kind: {
                        **stats,
                        "calls": stats["calls"] / n,
                        "bytes": stats["bytes"] / n,
                        "sent_bytes": stats["sent_bytes"] / n,
                    }
                    for kind, stats in kinds.items()
                }
                for group, kinds in comm.as_dict().items()
            },
        },
    }


def _model_flops(template: torch.nn.Module, batch: Batch, ctx: Context) -> float:
    """Model FLOPs of one training step (forward + backward) on one rank's batch."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(template).to(ctx.device)
    with FlopCounterMode(display=False) as counter:
        ctx.spec.loss(model(batch[0]), batch[1]).backward()
    del model
    return float(counter.get_total_flops())


def rank_main(rank: int, world_size: int, port: int, plan: JobPlan) -> dict[str, Any] | None:
    """Body of one rank (for :func:`kolossos.testing.spawn`); rank 0 returns the raw results."""
    import kolossos
    from benchmarks.suites import get_suite
    from kolossos.accelerator import get_accelerator

    # Deprecation chatter from torch and DeepSpeed internals, once per call site and rank, would
    # drown the progress lines; it says nothing about the measurement.
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    kolossos.launch(
        config={},
        rank=rank,
        world_size=world_size,
        host="127.0.0.1",
        port=port,
        verbose=False,
        timeout=plan.timeout,
    )
    torch.set_num_threads(plan.threads)
    spec = get_model(plan.model)
    device = get_accelerator().get_current_device()
    ctx = Context(spec=spec, device=device, precision=plan.precision, batch=plan.batch)
    available = get_suite(plan.suite).contenders()
    contenders = [available[name] for name in plan.contenders]
    torch.manual_seed(plan.seed)
    template = spec.build()
    num_params = sum(p.numel() for p in template.parameters())
    gen = torch.Generator().manual_seed(plan.seed + 7919 * rank)
    batches: list[Batch] = []
    for _ in range(max(plan.warmup + plan.steps, 1 + plan.account_steps)):
        inputs, targets = spec.make_batch(gen, plan.batch)
        batches.append((inputs.to(device), targets.to(device)))
    flops = _model_flops(template, batches[0], ctx) if rank == 0 else 0.0
    timings: dict[str, list[Any]] = {c.name: [] for c in contenders}
    for rep in range(plan.reps):  # A/B/A/B: every repetition runs each contender
        entries = time_repetition(plan.interleave, contenders, template, batches, plan.warmup, ctx)
        for name, entry in entries.items():
            timings[name].append(entry)
        if rank == 0:
            done = ", ".join(
                f"{n} {sum(e['wall']):.2f}s" for n, e in entries.items() if e is not None
            )
            print(
                f"[bench] {plan.suite}/{plan.model} rep {rep + 1}/{plan.reps}: {done}",
                file=sys.stderr,
                flush=True,
            )
    accounts = {c.name: _account(c, template, batches, plan, ctx) for c in contenders}
    gathered = gather_from_ranks({"timings": timings, "accounts": accounts})
    if rank != 0:
        return None
    return {
        "num_params": num_params,
        "flops_per_step_rank": flops,
        "device": str(device),
        "device_name": get_accelerator().get_device_name() if device.type != "cpu" else "cpu",
        "backend": str(dist.get_backend()),
        "per_rank": gathered,
    }
