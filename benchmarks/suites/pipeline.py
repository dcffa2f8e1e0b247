"""Pipeline suite: kolossos' schedules against ``torch.distributed.pipelining``'s implementation
of the same schedule, on the same stages, micro-batches, loss and optimizer.

Every rank holds the same stage modules for both contenders: the GPT-2 model is cut by hand
into an embedding stage, one stage per transformer block and a head stage (the LM head untied
from the embedding, which ``torch.distributed.pipelining`` cannot share across stages), split
uniformly over ``world_size x chunks`` virtual stages. A step pushes ``batch x world_size``
samples (the rank's batch, repeated: the first stage reads the inputs, the last the targets)
through ``2 x world_size`` micro-batches, so the runner's per-rank units stay right.

    python -m benchmarks pipeline --model gpt2-30m [--world-size 4]

Rows ``kolossos-pp-<schedule>`` are paired with ``torch-pp-<schedule>`` (ratio column "other
ratios"); every row is also divided by torch's 1F1B. The idle time of each schedule, measured by
kolossos' executor against the closed-form bubble, comes from the stand-alone table:

    python -m benchmarks.suites.pipeline [--pp 2 4] [--model gpt2-tiny] [--microbatches 8]

The "states MiB/rank (est)" column's estimate assumes a replicated model (it has no pipeline
strategy); the measured figure is the pipeline's.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.contenders import Contender, Context, Setup
from benchmarks.models import CausalLM
from benchmarks.suites import Suite

#: schedule -> (torch.distributed.pipelining class, chunks per rank, layout)
TORCH_SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}
#: kolossos schedule -> (chunks per rank, layout, torch counterpart)
KOLOSSOS_SCHEDULES: dict[str, tuple[int, str, str]] = {
    "gpipe": (1, "loop", "gpipe"),
    "1f1b": (1, "loop", "1f1b"),
    "interleaved": (2, "loop", "interleaved"),
    "zbh1": (1, "loop", "1f1b"),
    "zbv": (2, "v", "zbv"),
}


# --- the model, cut by hand ----------------------------------------------------------------------
class GPT2Embedding(nn.Module):
    """Token and position embeddings (stage input: token ids)."""

    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.drop(self.wte(ids) + self.wpe(pos)[None])
        return out


class GPT2BlockStage(nn.Module):
    """One transformer block on hidden states (causal through SDPA's ``is_causal``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class GPT2Head(nn.Module):
    """Final norm and an LM head with its own copy of the embedding matrix."""

    def __init__(self, transformer: Any, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f = transformer.ln_f
        self.lm_head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln_f(hidden))
        return logits


def gpt2_layers(model: nn.Module) -> list[nn.Module]:
    """The pipeline layers of a benchmark GPT-2: embedding, blocks, head.

    Raises:
        ValueError: not a GPT-2 benchmark model, or attention other than SDPA (calling blocks
            without a mask is causal only through SDPA).
    """
    if not isinstance(model, CausalLM):
        raise ValueError(
            f"the pipeline suite cuts GPT-2 models only, got {type(model).__name__}; run it "
            "with --model gpt2-tiny / gpt2-30m / gpt2-50m."
        )
    hf: Any = model.model
    if hf.config._attn_implementation != "sdpa":
        raise ValueError("the hand-cut GPT-2 stages need attn_implementation='sdpa'.")
    blocks = [GPT2BlockStage(b) for b in hf.transformer.h]
    return [GPT2Embedding(hf.transformer), *blocks, GPT2Head(hf.transformer, hf.lm_head)]


def local_chunks(model: nn.Module, chunks: int, layout: str) -> tuple[list[nn.Module], list[int]]:
    """This rank's stage modules and their virtual stage indices (uniform split)."""
    from kolossos.pipeline.layout import stage_of
    from kolossos.pipeline.partition import partition_layers

    world, rank = dist.get_world_size(), dist.get_rank()
    layers = gpt2_layers(model)
    parts = partition_layers(layers, world, chunks, layout=layout)[rank]
    modules: list[nn.Module] = [nn.Sequential(*layers[s:e]) for s, e in parts]
    stages = [stage_of(rank, c, world, chunks, layout) for c in range(chunks)]
    return modules, stages


def microbatches(batch: int) -> int:
    """``2 x world`` micro-batches when the repeated batch splits evenly, else ``world``."""
    world = dist.get_world_size()
    return 2 * world if (batch * world) % (2 * world) == 0 else world


def _global(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x] * dist.get_world_size())


def _setup(
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], modules: list[nn.Module], lr: float
) -> Setup:
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.Adam(params, lr=lr)
    return Setup(
        forward_loss=run,  # forward and backward of the whole step happen here
        backward=lambda loss: None,
        step=optimizer.step,
        zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
        track=[*modules, optimizer],
    )


# --- contenders ----------------------------------------------------------------------------------
_MESH: list[Any] = []


class KolossosPipeline(Contender):
    """A kolossos schedule run by ``PipelineSchedule.forward_backward_step``."""

    role = "kolossos"

    def __init__(self, schedule: str) -> None:
        self.schedule = schedule
        chunks, self.layout, twin = KOLOSSOS_SCHEDULES[schedule]
        self.chunks = chunks
        self.name = f"kolossos-pp-{schedule}"
        self.counterpart = f"torch-pp-{twin}"
        self.description = f"kolossos.pipeline {schedule}, {chunks} chunk(s) per rank"
        self.runner: Any = None

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        from kolossos.cluster import ProcessGroupMesh
        from kolossos.pipeline import PipelineStageManager, create_schedule

        if not _MESH:  # one mesh per job: creating process groups is slow on gloo
            _MESH.append(ProcessGroupMesh(dist.get_world_size(), axis_names=("pp",)))
        sm = PipelineStageManager(_MESH[0], "pp", num_model_chunks=self.chunks, layout=self.layout)
        modules, _ = local_chunks(model, self.chunks, self.layout)
        self.runner = create_schedule(self.schedule, sm, num_microbatches=microbatches(ctx.batch))
        runner, loss_fn = self.runner, ctx.spec.loss

        def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self._autocast(ctx):
                out = runner.forward_backward_step(
                    modules, iter([(_global(x), _global(y))]), loss_fn
                )
            return out["loss"] if out["loss"] is not None else torch.zeros(())

        return _setup(run, modules, ctx.lr)


class TorchPipelining(Contender):
    """The same schedule from ``torch.distributed.pipelining`` on the same stage modules."""

    def __init__(self, schedule: str) -> None:
        self.schedule = schedule
        self.cls_name, self.chunks, self.layout = TORCH_SCHEDULES[schedule]
        self.name = f"torch-pp-{schedule}"
        self.description = f"torch.distributed.pipelining.{self.cls_name}"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        import torch.distributed.pipelining as pipelining

        world = dist.get_world_size()
        modules, stage_ids = local_chunks(model, self.chunks, self.layout)
        stages = [
            pipelining.PipelineStage(m, s, world * self.chunks, ctx.device)
            for m, s in zip(modules, stage_ids, strict=True)
        ]
        cls = getattr(pipelining, self.cls_name)
        arg = stages[0] if self.chunks == 1 else stages
        schedule = cls(arg, n_microbatches=microbatches(ctx.batch), loss_fn=ctx.spec.loss)
        first, last = 0 in stage_ids, world * self.chunks - 1 in stage_ids

        def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            losses: list[torch.Tensor] = []
            args = (_global(x),) if first else ()
            kwargs: dict[str, Any] = {"target": _global(y), "losses": losses} if last else {}
            with self._autocast(ctx):
                schedule.step(*args, **kwargs)
            return torch.stack(losses).mean() if losses else torch.zeros(())

        return _setup(run, modules, ctx.lr)


def _contenders() -> dict[str, Contender]:
    rows: list[Contender] = [TorchPipelining(s) for s in TORCH_SCHEDULES]
    rows += [KolossosPipeline(s) for s in KOLOSSOS_SCHEDULES]
    return _quick_filter({c.name: c for c in rows})


SUITE = Suite(
    name="pipeline",
    description="kolossos pipeline schedules vs torch.distributed.pipelining, same stages",
    contenders=_contenders,
    references=("torch-pp-1f1b",),
    preimport=("torch.distributed.pipelining", "kolossos.pipeline"),
    quick_models=("gpt2-tiny",),
)


# --- stand-alone: idle time per schedule against the closed form --------------------------------
def _quick_filter(rows: dict[str, Contender]) -> dict[str, Contender]:
    """``--quick`` smoke runs keep the 1F1B and ZB-V pairs (the runner's argv, inherited by the
    forked ranks, is the only switch a suite can see)."""
    if "--quick" not in sys.argv:
        return rows
    keep = ("torch-pp-1f1b", "kolossos-pp-1f1b", "torch-pp-zbv", "kolossos-pp-zbv")
    return {k: rows[k] for k in keep}


def _idle_spec() -> Any:
    """A balanced GPT-2 for bubble measurements: 6 equal blocks, a small vocabulary, so the
    embedding and head stages cost about as much as a block."""
    from benchmarks.models import _gpt2_spec

    return _gpt2_spec("gpt2-pp", 6, 128, 4, 256, 64)


def _kind_costs(timeline: list[tuple[str, float, float, float]]) -> dict[str, float]:
    """Mean compute seconds of F, B and W actions from an executor timeline."""
    by: dict[str, list[float]] = {}
    for action, start, end, wait in timeline:
        by.setdefault(action[0], []).append(end - start - wait)
    return {k: statistics.mean(v) for k, v in by.items()}


def _time_pair(
    setups: list[Setup], batch: tuple[torch.Tensor, torch.Tensor], walls: list[list[float]]
) -> None:
    from benchmarks.contenders import train_step

    for setup, out in zip(setups, walls, strict=True):
        dist.barrier()  # both contenders start every step with the ranks aligned
        start = time.perf_counter()
        train_step(setup, batch)
        out.append(time.perf_counter() - start)


def _idle_rank(rank: int, world_size: int, port: int, opts: dict[str, Any]) -> Any:
    """One pipeline size: every kolossos schedule A/B against its torch twin, step by step."""
    import copy

    import kolossos
    from kolossos.utils.profiling.memory import gather_from_ranks

    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    verbose=False)  # fmt: skip
    torch.set_num_threads(opts["threads"])
    spec = _idle_spec()
    torch.manual_seed(0)
    template = spec.build()
    gen = torch.Generator().manual_seed(1)
    batches = [spec.make_batch(gen, opts["batch"]) for _ in range(opts["steps"] + 1)]
    ctx = Context(spec=spec, device=torch.device("cpu"), precision="fp32", batch=opts["batch"])
    result: dict[str, Any] = {}
    for name in KOLOSSOS_SCHEDULES:
        ours = KolossosPipeline(name)
        twin = TorchPipelining(ours.counterpart.removeprefix("torch-pp-"))
        setups = [c.setup(copy.deepcopy(template), ctx) for c in (ours, twin)]
        walls: list[list[float]] = [[], []]
        _time_pair(setups, batches[0], [[], []])  # warm-up (torch infers shapes here)
        idle: list[float] = []
        costs: list[dict[str, float]] = []
        for batch in batches[1:]:
            _time_pair(setups if len(idle) % 2 == 0 else setups[::-1], batch,
                       walls if len(idle) % 2 == 0 else walls[::-1])  # fmt: skip
            idle.append(ours.runner.last_stats.idle_fraction)
            costs.append(_kind_costs(ours.runner.last_stats.timeline))
        result[name] = {"walls": walls, "idle": statistics.mean(idle),
                        "costs": {k: statistics.mean(c[k] for c in costs) for k in costs[0]},
                        "m": ours.runner.config.num_microbatches, "twin": twin.name}  # fmt: skip
    gathered = gather_from_ranks(result)
    return gathered if rank == 0 else None


def _idle_rows(per_rank: list[dict[str, Any]], pp: int) -> list[dict[str, Any]]:
    from kolossos.pipeline.schedule.registry import build_table
    from kolossos.pipeline.simulate import Costs, closed_form_bubble, simulate

    rows = []
    for name in KOLOSSOS_SCHEDULES:
        runs = [r[name] for r in per_rank]
        m = runs[0]["m"]
        cost = {k: statistics.mean(r["costs"].get(k, 0.0) for r in runs) for k in "FBW"}
        table = build_table(name, pp, m)
        split = table.split_backward
        measured = Costs(forward=cost["F"], backward=cost["B"], input_grad=cost["B"],
                         weight_grad=cost["W"] if split else 0.0)  # fmt: skip
        ours = [max(col) for col in zip(*(r["walls"][0] for r in runs), strict=True)]
        theirs = [max(col) for col in zip(*(r["walls"][1] for r in runs), strict=True)]
        rows.append({
            "schedule": name, "pp": pp, "m": m, "twin": runs[0]["twin"],
            "closed_form": closed_form_bubble(name, pp, m, table.num_chunks),
            "simulated_unit": simulate(table).bubble_fraction,
            "simulated_measured_costs": simulate(table, measured).bubble_fraction,
            "measured_idle": statistics.mean(r["idle"] for r in runs),
            "kolossos_step_s": statistics.median(ours), "twin_step_s": statistics.median(theirs),
        })  # fmt: skip
    return rows


def _format(rows: list[dict[str, Any]]) -> str:
    head = ("schedule", "pp", "m", "closed form", "sim (F=1,B=2|1,W=1)", "sim (measured costs)",
            "measured idle", "kolossos ms", "torch twin", "twin ms", "speed vs twin")  # fmt: skip
    body = []
    for r in rows:
        closed = "-" if r["closed_form"] is None else f"{r['closed_form']:.3f}"
        body.append((r["schedule"], str(r["pp"]), str(r["m"]), closed,
                     f"{r['simulated_unit']:.3f}", f"{r['simulated_measured_costs']:.3f}",
                     f"{r['measured_idle']:.3f}", f"{1e3 * r['kolossos_step_s']:.1f}",
                     r["twin"], f"{1e3 * r['twin_step_s']:.1f}",
                     f"{r['twin_step_s'] / r['kolossos_step_s']:.2f}"))  # fmt: skip
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in (head, *body)
    ]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    """Idle fraction of every kolossos schedule (measured by its executor) against the closed
    form and the simulator, and its step time against torch's twin schedule."""
    import json
    import os

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suites.pipeline", description=main.__doc__
    )
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes")
    p.add_argument("--batch", type=int, default=8, help="samples per rank (x pp per step)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per contender")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # before forking: children of a process whose pool ran hang
    importlib.import_module("torch.distributed.pipelining")  # inherited by the forked ranks

    from kolossos.testing import spawn

    opts = {"batch": args.batch, "steps": args.steps, "threads": args.threads}
    rows = []
    for pp in args.pp:
        per_rank = spawn(_idle_rank, pp, timeout=1800, opts=opts)[0]
        rows += _idle_rows(per_rank, pp)
        print(f"[pipeline] pp={pp} done", file=sys.stderr, flush=True)
    print(_format(rows))
    for row in rows:
        print(json.dumps(row, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
