"""Sequence parallelism on P ranks: activation memory per rank, the longest sequence a fixed
per-rank memory budget trains, and bytes communicated, against one process and tensor
parallelism (issue 23; the shape of arXiv 2105.13120's "3.0x longer sequences than TP").

The model (:mod:`benchmarks.sequence_parallel_model`) is a stack of pre-LN blocks fed random
hidden states, fp32, causal attention; only the attention and where the sequence lives differ:
one process (SDPA, and attention written out: ``_eager``), Megatron 1D tensor parallelism (the
same two), ring self-attention, Ulysses, ring attention (zig-zag), and PyTorch's
``context_parallel`` where it runs. For each rank count (1, 2, 4) one job forks the ranks; per
mode, every figure is one forward + backward:

* **activation memory**: every tensor storage of the rank counted by a
  :class:`~kolossos.accelerator.TensorMemoryTracker` (exact on the CPU), the model's parameters
  and their gradient buffers (allocated beforehand) excluded: the peak over forward + backward
  (``peak``) and what forward leaves for backward (``saved``); the largest over the ranks;
* **longest sequence** whose activation peak fits the budget (the single-process SDPA peak at
  ``--budget-seq`` tokens): doubling, then bisection in steps of ``lcm(8, 2P)`` tokens;
* **bytes sent per rank** (:class:`~kolossos.utils.profiling.CommCounter`) of the forward +
  backward next to the kernels' closed forms (``ring_self_attention_bytes``,
  ``ulysses_comm_bytes``, ``ring_attention_comm_bytes``; Megatron TP: two all-reduces of the
  ``b·S·h`` activations per layer each way), plus the gradient all-reduce the sequence modes
  need for their replicated parameters (``2(P-1)/P·Ψ`` elements).

Usage::

    python -m benchmarks sequence_parallel --quick     # smoke run (~1 min, 2 cores)
    python -m benchmarks sequence_parallel             # docs/sequence_parallel.md (~4 min)
    python -m benchmarks.sequence_parallel --seq 1024 --budget-seq 256 --worlds 2 4
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks.sequence_parallel_model import MODES, SEQUENCE_MODES, Shape

#: modes run in one process only, and the parallel ones (also run on one rank: their own base)
SINGLE_MODES = ("single", "single_eager")
SPLIT_MODES = ("tp", "tp_eager", "rsa", "ulysses", "ring_attn")
PREIMPORT = (
    "torch.distributed.tensor.experimental",
    "kolossos.initialize",
    "kolossos.nn.layer.parallel_1d",
    "kolossos.sequence",
    "kolossos.utils.profiling",
)

__all__ = ["Plan", "format_tables", "main", "parse_args", "rank_main"]


@dataclass(frozen=True)
class Plan:
    """One job's work (picklable)."""

    shape: Shape
    seq: int
    """sequence length of the memory and traffic measurements"""
    budget: int = 0
    """per-rank activation budget in bytes for the search (0: no search)"""
    budget_seq: int = 256
    modes: tuple[str, ...] = MODES
    max_seq: int = 1 << 16
    """the search gives up above this length"""
    timeout: float = 600.0


# --------------------------------------------------------------------------- one rank
def _agreed_max(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def _activation_bytes(model: Any, mode: str, plan: Plan, seq: int) -> tuple[int, int]:
    """``(peak, saved)`` activation bytes of one forward + backward, the largest over ranks."""
    import torch
    import torch.distributed as dist

    from benchmarks.sequence_parallel_model import make_input
    from kolossos.accelerator import TensorMemoryTracker

    world, device = dist.get_world_size(), next(model.parameters()).device
    gc.collect()
    with TensorMemoryTracker(device) as tracker:
        tracker.track(model)  # parameters and their gradient buffers: not activations
        base = tracker.current_bytes
        tracker.reset_peak()
        x, ctx = make_input(mode, plan.shape, seq, world, device)
        with ctx:
            loss = model(x).pow(2).mean()
            saved = tracker.current_bytes - base
            loss.backward()
        del loss, x
        peak = tracker.peak_bytes - base
    if world > 1:
        dist.all_reduce(torch.zeros(1, device=device))  # gloo frees its last collective's buffer
    peak_all, saved_all = _agreed_max([peak, saved])
    return int(peak_all), int(saved_all)


def _closed_form(mode: str, shape: Shape, seq: int, world: int) -> float | None:
    """Bytes one rank sends in one forward + backward of the whole model (the kernels' forms)."""
    import torch

    from kolossos.sequence import (
        ring_attention_comm_bytes,
        ring_self_attention_bytes,
        ulysses_comm_bytes,
    )

    b, a, h, s = shape.batch, shape.heads, shape.hidden, seq // world
    t = torch.empty(b, a, s, h // a, device="meta")
    if world == 1:
        return 0.0
    if mode.startswith("tp"):  # all-reduce (ring): out of attention and MLP fwd, inputs bwd
        per_layer = 4 * 2 * (world - 1) / world * b * seq * h * 4
    elif mode == "rsa":
        per_layer = sum(ring_self_attention_bytes(b * a, s, h // a, world).values())
    elif mode == "ulysses":
        per_layer = ulysses_comm_bytes(t, t, t, world)
    elif mode == "ring_attn":
        per_layer = ring_attention_comm_bytes(t, t, world)
    else:
        return None
    return per_layer * shape.layers


def _traffic(model: Any, mode: str, plan: Plan) -> dict[str, Any]:
    """Bytes this rank sends in one forward + backward, and in the gradient all-reduce."""
    import torch
    import torch.distributed as dist

    from benchmarks.sequence_parallel_model import make_input
    from kolossos.utils.profiling import CommCounter

    world, device = dist.get_world_size(), next(model.parameters()).device
    with CommCounter() as comm:
        x, ctx = make_input(mode, plan.shape, plan.seq, world, device)
        with ctx:
            model(x).pow(2).mean().backward()
    sync_sent = 0.0
    if mode in SEQUENCE_MODES and world > 1:  # replicated parameters: average the gradients
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        with CommCounter() as sync:
            dist.all_reduce(flat)
        sync_sent = sync.sent_bytes()
    kinds = {k: comm.bytes(k) for k in ("send", "all_reduce", "all_to_all", "all_gather")}
    return {
        "sent": comm.sent_bytes(),
        "logical_by_kind": {k: v for k, v in kinds.items() if v},
        "calls": comm.calls(),
        "closed_form": _closed_form(mode, plan.shape, plan.seq, world),
        "grad_sync_sent": sync_sent,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _longest(model: Any, mode: str, plan: Plan) -> dict[str, Any]:
    """The longest sequence whose activation peak fits ``plan.budget``."""
    import torch.distributed as dist

    world = dist.get_world_size()
    unit = math.lcm(8, 2 * world)
    fits: dict[int, bool] = {}

    def ok(n: int) -> bool:
        if n not in fits:
            fits[n] = _activation_bytes(model, mode, plan, n * unit)[0] <= plan.budget
        return fits[n]

    n = max(1, plan.budget_seq // unit)
    if ok(n):  # double until it no longer fits
        lo, hi = n, 2 * n
        while hi * unit <= plan.max_seq and ok(hi):
            lo, hi = hi, 2 * hi
        if hi * unit > plan.max_seq:
            return {"seq": lo * unit, "capped": True, "probes": len(fits)}
    else:  # halve until it fits (0: not even one unit does)
        lo, hi = n // 2, n
        while lo and not ok(lo):
            lo, hi = lo // 2, lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"seq": lo * unit, "capped": False, "probes": len(fits)}


def _mode_row(mode: str, plan: Plan) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from benchmarks.sequence_parallel_model import build
    from kolossos.accelerator import get_accelerator

    world = dist.get_world_size()
    row: dict[str, Any] = {"mode": mode, "ranks": world, "seq": plan.seq}
    device = get_accelerator().get_current_device()
    torch.manual_seed(0)
    model = build(mode, plan.shape, dist.group.WORLD).to(device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    start = time.perf_counter()
    try:
        _activation_bytes(model, mode, plan, math.lcm(8, 2 * world))  # warm-up
        peak, saved = _activation_bytes(model, mode, plan, plan.seq)
        row.update(status="ok", peak=peak, saved=saved, comm=_traffic(model, mode, plan))
        if plan.budget:
            row["longest"] = _longest(model, mode, plan)
    except Exception as exc:  # a mode that cannot run here reports why (torch_cp on the CPU)
        if mode != "torch_cp":
            raise
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()] or ["?"]
        row.update(status="not run", reason=f"{type(exc).__name__}: {lines[0][:160]}")
    row["wall_s"] = round(time.perf_counter() - start, 2)
    return row


def rank_main(rank: int, world_size: int, port: int, plan: Plan) -> list[dict[str, Any]] | None:
    """Body of one rank (for :func:`kolossos.testing.spawn`); rank 0 returns the rows."""
    import warnings

    import torch

    import kolossos

    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    verbose=False, timeout=plan.timeout)  # fmt: skip
    torch.set_num_threads(1)
    rows = []
    for mode in plan.modes:
        rows.append(_mode_row(mode, plan))
        if rank == 0:
            print(f"[seqpar] P={world_size} {mode}: {rows[-1].get('status')} "
                  f"({rows[-1]['wall_s']} s)", file=sys.stderr, flush=True)  # fmt: skip
    return rows if rank == 0 else None


# --------------------------------------------------------------------------- the driver
@dataclass
class _Results:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def get(self, mode: str, ranks: int) -> dict[str, Any] | None:
        for row in self.rows:
            if row["mode"] == mode and row["ranks"] == ranks and row["status"] == "ok":
                return row
        return None


def _derive(res: _Results) -> None:
    """Ratios: to the single-process figure, to the same mode on one rank, to TP at the same P."""
    single = res.get("single", 1)
    for row in res.rows:
        if row["status"] != "ok":
            continue
        p, base = row["ranks"], res.get(row["mode"], 1)
        if single:
            row["peak_vs_single"] = row["peak"] / single["peak"]
        if base:
            row["peak_vs_1rank"] = row["peak"] / base["peak"]
            row["peak_vs_1rank_times_p"] = row["peak_vs_1rank"] * p
        comm = row["comm"]
        if comm["closed_form"]:
            comm["measured_vs_closed_form"] = comm["sent"] / comm["closed_form"]
        if "longest" in row:
            length = row["longest"]["seq"]
            if single and "longest" in single:
                row["longest"]["vs_single"] = length / single["longest"]["seq"]
            for tp in ("tp", "tp_eager"):
                ref = res.get(tp, p)
                if ref and "longest" in ref:
                    row["longest"][f"vs_{tp}"] = length / ref["longest"]["seq"]


def _f(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def format_tables(rows: list[dict[str, Any]], budget: int, budget_seq: int) -> str:
    """The three tables (memory, longest sequence, traffic) as Markdown."""
    mib = 2**20
    out = ["| mode | P | tokens/rank | act. peak/rank | saved for bwd | ÷ single | ÷ same mode, "
           "P=1 | × P |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    seq_out = [f"| mode | P | longest S within {budget / mib:.2f} MiB | ÷ single | ÷ tp | "
               "÷ tp_eager |", "|---|---|---|---|---|---|"]  # fmt: skip
    comm_out = ["| mode | P | sent/rank fwd+bwd (measured) | closed form | ratio | logical "
                "by kind | grad all-reduce sent |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        head = f"| {r['mode']} | {r['ranks']} "
        if r["status"] != "ok":
            note = f"| {r['status']}: {r['reason']} |"
            out.append(head + note + " |" * 6)
            seq_out.append(head + note + " |" * 3)
            comm_out.append(head + note + " |" * 4)
            continue
        tokens = r["seq"] // r["ranks"] if r["mode"] in SEQUENCE_MODES else r["seq"]
        out.append(
            head + f"| {tokens} | {r['peak'] / mib:.2f} MiB | {r['saved'] / mib:.2f} MiB | "
            f"{_f(r.get('peak_vs_single'))} | {_f(r.get('peak_vs_1rank'))} | "
            f"{_f(r.get('peak_vs_1rank_times_p'))} |"
        )
        if "longest" in r:
            lg = r["longest"]
            seq_txt = f"{lg['seq']}{'+ (capped)' if lg['capped'] else ''}"
            seq_out.append(head + f"| {seq_txt} | {_f(lg.get('vs_single'))} | "
                           f"{_f(lg.get('vs_tp'))} | {_f(lg.get('vs_tp_eager'))} |")  # fmt: skip
        c = r["comm"]
        kinds = ", ".join(f"{k} {v:,.0f}" for k, v in c["logical_by_kind"].items()) or "—"
        closed = c["closed_form"]
        comm_out.append(
            head + f"| {c['sent']:,.0f} | {_f(closed, ',.0f')} | "
            f"{_f(c.get('measured_vs_closed_form'), '.3f')} | {kinds} | "
            f"{c['grad_sync_sent']:,.0f} |"
        )
    title = (f"Activation memory per rank, one forward + backward (budget for the search: the "
             f"single-process peak at S = {budget_seq})")  # fmt: skip
    return "\n".join([title, "", *out, "", *seq_out, "", *comm_out])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``python -m benchmarks.sequence_parallel --help``)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.sequence_parallel",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke sizes (about a minute)")
    p.add_argument("--worlds", type=int, nargs="+", help="rank counts besides 1 (default 2 4)")
    p.add_argument("--seq", type=int, help="sequence length of the memory/traffic table")
    p.add_argument("--budget-seq", type=int, help="single-process length that sets the budget")
    p.add_argument("--hidden", type=int, help="model width")
    p.add_argument("--heads", type=int, help="attention heads (divisible by every P)")
    p.add_argument("--layers", type=int, help="blocks")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--no-search", action="store_true", help="skip the longest-sequence search")
    p.add_argument("--timeout", type=float, default=1800.0, help="wall-clock limit per job (s)")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    quick = {"seq": 128, "budget_seq": 64, "hidden": 32, "heads": 4, "layers": 1}
    full = {"seq": 1024, "budget_seq": 256, "hidden": 256, "heads": 4, "layers": 2}
    if args.worlds is None:
        args.worlds = [2, 4]
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for world in args.worlds:
        if world < 2 or args.heads % world or args.seq % math.lcm(8, 2 * world):
            p.error(f"--worlds {world}: needs >= 2 ranks, --heads ({args.heads}) divisible by it "
                    f"and --seq ({args.seq}) divisible by lcm(8, 2P)")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every job and print the tables and one JSON line; 1 if a mode failed."""
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # before forking: children of a process whose pool ran hang
    from kolossos.testing import spawn

    for name in PREIMPORT:  # the forked ranks inherit them and start in milliseconds
        importlib.import_module(name)

    shape = Shape(hidden=args.hidden, heads=args.heads, layers=args.layers, batch=args.batch)
    plan = Plan(shape=shape, seq=args.seq, budget_seq=args.budget_seq, timeout=args.timeout)
    began = time.perf_counter()
    # one rank: the single-process figures, which set the budget, and every mode at P = 1
    at_budget = replace(plan, seq=args.budget_seq, modes=("single",))
    budget_row = spawn(rank_main, 1, timeout=args.timeout, plan=at_budget)[0][0]
    budget = 0 if args.no_search else int(budget_row["peak"])
    plan = replace(plan, budget=budget)
    res = _Results()
    for world in (1, *args.worlds):  # one process: every mode but torch's (it needs 2+ ranks)
        modes = (*SINGLE_MODES, *SPLIT_MODES) if world == 1 else (*SPLIT_MODES, "torch_cp")
        job = replace(plan, modes=modes)
        res.rows += spawn(rank_main, world, timeout=args.timeout, plan=job)[0]
    _derive(res)
    print(format_tables(res.rows, budget, args.budget_seq))
    wall = round(time.perf_counter() - began, 1)
    record = {"benchmark": "sequence_parallel", "plan": asdict(plan), "rows": res.rows,
              "wall_s": wall, "torch": torch.__version__}  # fmt: skip
    print(json.dumps(record, default=str), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, default=str)
    return 1 if any(r["status"] not in ("ok", "skipped", "not run") for r in res.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
