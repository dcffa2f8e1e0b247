"""Predicted vs measured step time and peak memory of ``autoparallelize``'s GPT-2 plans on CPU.

Run ``python -m benchmarks.auto_parallel_gpt2`` (spawns 2 and then 4 gloo ranks; at 4 also the
2 x 2 mesh, ``dp2xtp2``; ``mixed`` is the ILP's own plan at the budget between data parallel and
Megatron, run by the graph executor, when it is none of the families). Each rank
calibrates the cost model on the spot, on synthetic work only (never the benchmarked models):
the matmul rate at the model's MLP shape, the cost of one small ATen operator (forward +
backward) and of one byte written by a memory-bound operator, the optimizer's cost per
parameter tensor and per byte, the cost of copying a byte, gloo's all-reduce inverse bandwidth
(back-to-back all-reduces of 1 element and 4 MiB) and the cost of one activation all-reduce
inside a step (a probe of matmuls with autograd all-reduces between them, with and without the
collectives; for ``dp2xtp2`` over a pair of ranks). Per plan it also measures how much slower the
ranks compute side by side than alone, on synthetic work as long as the plan's predicted step
(:func:`~kolossos.auto_parallel.calibrate.measure_contention`), and re-prices the plan with the
compute that much slower (:func:`~kolossos.auto_parallel.calibrate.contended`).
Then for every case it prices the plan family with
:func:`~kolossos.auto_parallel.transformer_plan.family_plan`, builds it with
:func:`~kolossos.auto_parallel.apply_transformer.apply_family`, and measures the step (forward,
backward, Adam; per step the slowest rank; the fastest of STEPS steps, and the median) and the
peak tensor bytes of one step with :class:`~kolossos.accelerator.TensorMemoryTracker`. The
compute calibration takes the fastest of its loops too (on a machine shared with other jobs the
fastest run is the one least disturbed). Prints one markdown row per case.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from kolossos.auto_parallel.calibrate import contended, measure_contention, slowest

__all__ = ["MODELS", "main"]

MODELS: dict[str, dict[str, int]] = {
    "gpt2-l2-h32": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "batch": 8, "seq": 24},
    "gpt2-l2-h64": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "batch": 4, "seq": 32},
    "gpt2-l4-h256": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 512, "batch": 4, "seq": 64},
}
STEPS = 20


def _gpt2(spec: dict[str, int]) -> torch.nn.Module:
    import transformers as tf

    config = tf.GPT2Config(n_layer=spec["layers"], n_embd=spec["hidden"], n_head=spec["heads"],
                           vocab_size=spec["vocab"], n_positions=max(64, spec["seq"]),
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


def _times(fn: Any, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _best(fn: Any, repeats: int) -> float:
    """The fastest of ``repeats`` runs (the least disturbed by other jobs on the machine)."""
    return min(_times(fn, repeats))


class _Reduce(torch.autograd.Function):
    """All-reduce in forward (a row-parallel output) or in backward (a column-parallel
    input's gradient), as ShardFormer's layers do; ``comm=False`` keeps the same autograd
    structure without the collective."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, backward: bool, comm: bool, group: Any) -> torch.Tensor:
        ctx.backward, ctx.comm, ctx.group = backward, comm, group
        x = x.clone()
        if comm and not backward:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.clone()
        if ctx.comm and ctx.backward:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None, None


def _in_step_collective(
    tokens: int, hidden: int, group: Any = None, blocks: int = 6, repeats: int = 12
) -> float:
    """Cost of one activation all-reduce inside a training step, from a synthetic probe (not
    the benchmarked models): ``blocks`` pairs of ``tokens x hidden`` matmuls, one all-reducing
    its output in forward and one its input gradient in backward, timed forward + backward
    with and without the collectives (per step the slowest rank, median of ``repeats``);
    the difference over the ``2·blocks`` collectives. Inside a step the ranks are out of step
    and each waits for the others to be scheduled, which back-to-back all-reduces hide."""
    weights = [(torch.randn(hidden, hidden) / hidden**0.5).requires_grad_() for _ in range(2)]
    x = torch.randn(tokens, hidden, requires_grad=True)

    def step(comm: bool) -> None:
        y = x
        for _ in range(blocks):
            y = _Reduce.apply(y @ weights[0], True, comm, group)
            y = _Reduce.apply(y @ weights[1], False, comm, group)
        y.sum().backward()

    medians = []
    for comm in (True, False):
        step(comm)
        times = torch.tensor(_times(lambda c=comm: step(c), repeats), dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        medians.append(float(times.median()))
    return max(medians[0] - medians[1], 0.0) / (2 * blocks)


def calibrate(world_size: int, spec: dict[str, int]) -> dict[str, float]:
    """The cost-model constants measured on this machine (collective: every rank calls it)."""
    from kolossos.auto_parallel.calibrate import measure_compute, measure_optimizer

    small, large = torch.zeros(1), torch.zeros(1 << 20)
    best_alpha = _best(lambda: dist.all_reduce(small), 30)
    t_large = _best(lambda: dist.all_reduce(large), 8)
    volume = 2 * (world_size - 1) / world_size * large.numel() * 4
    beta = max(t_large - best_alpha, 0.0) / volume
    tokens, hidden = spec["batch"] * spec["seq"], spec["hidden"]
    alpha = max(_in_step_collective(tokens // world_size, hidden), best_alpha)
    compute = measure_compute(tokens, hidden)
    optimizer = measure_optimizer()
    return {
        "alpha": slowest(alpha),
        "beta": slowest(beta),
        "flops_per_s": 1.0 / slowest(1.0 / compute["flops_per_s"]),
        "op_s": slowest(compute["op_s"]),
        "op_byte_s": slowest(compute["op_byte_s"]),
        "optimizer_tensor_s": slowest(optimizer["tensor_s"]),
        "optimizer_byte_s": slowest(optimizer["byte_s"]),
        "copy_byte_s": slowest(optimizer["copy_byte_s"]),
    }


def _measure(model: Any, spec: dict[str, int]) -> tuple[float, float, float]:
    from kolossos.accelerator import TensorMemoryTracker

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]))
    batch = model.local_batch(ids)

    def step() -> None:
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    # Per step the slowest rank counts; then the fastest and the median step.
    per_step = torch.tensor(_times(step, STEPS), dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    best, median = float(per_step.min()), float(per_step.median())
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model, opt)
        tracker.reset_peak()
        step()
    return best, median, slowest(float(tracker.peak_bytes))


def _rank(
    rank: int, world_size: int, port: int, models: list[str], wanted: list[str]
) -> list[tuple[Any, ...]]:
    import kolossos
    from kolossos.auto_parallel import CostModel
    from kolossos.auto_parallel.apply_graph import apply_graph_plan
    from kolossos.auto_parallel.apply_transformer import apply_family
    from kolossos.auto_parallel.auto_mesh import resolve_mesh
    from kolossos.auto_parallel.module_graph import trace_operators
    from kolossos.auto_parallel.sharding_graph import evaluate
    from kolossos.auto_parallel.transformer_plan import (
        family_plan,
        hybrid_plan,
        search_free,
        search_transformer_plan,
    )
    from kolossos.auto_parallel.transformer_strategies import transformer_graph

    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    backend="gloo", seed=0, verbose=False)  # fmt: skip
    torch.set_num_threads(1)
    mesh = resolve_mesh(None).flat
    rows = []
    for name in models:
        spec = MODELS[name]
        cost = CostModel(world_size=world_size, **calibrate(world_size, spec))
        ids = torch.empty(spec["batch"], spec["seq"], dtype=torch.long, device="meta")
        groups = trace_operators(_gpt2(spec), {"input_ids": ids, "labels": ids})
        plans = {f: family_plan(f, groups, cost) for f in ("dp", "megatron", "replicated")}
        graphs = dict.fromkeys(plans, transformer_graph(groups, cost))
        hybrid = {}
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world_size == 4 else []
        if world_size == 4:  # the 2 x 2 mesh: Megatron in pairs, data parallel across
            half = torch.empty(spec["batch"] // 2, spec["seq"], dtype=torch.long, device="meta")
            hybrid[2] = trace_operators(_gpt2(spec), {"input_ids": half, "labels": half})
            plans["dp2xtp2"] = hybrid_plan(hybrid[2], cost, 2)
            graphs["dp2xtp2"] = transformer_graph(hybrid[2], cost)
        unlimited, _ = search_transformer_plan(groups, cost, None, hybrid)
        # The ILP's own plan at the budget between data parallel and Megatron: run by the
        # graph executor when it mixes strategies (not one of the families).
        between = (plans["dp"].memory + plans["megatron"].memory) / 2
        mixed = search_free(groups, cost, between)
        if all(mixed.strategies != p.strategies for p in plans.values()):
            plans["mixed"] = mixed
            graphs["mixed"] = transformer_graph(groups, cost)
        for family, plan in plans.items():
            if wanted and family not in wanted:
                continue
            chosen, _ = search_transformer_plan(groups, cost, plan.memory, hybrid)
            if family == "mixed":
                budget = f"{between / 2**20:.2f} MiB (ILP)"
            elif family == unlimited:
                budget = "none"
            elif chosen == family:
                budget = f"{plan.memory / 2**20:.2f} MiB"
            else:
                budget = f"forced ({chosen} chosen at its memory)"
            torch.manual_seed(0)
            model: Any
            if family == "mixed":
                samples = {"input_ids": ids, "labels": ids}
                model = apply_graph_plan(_gpt2(spec), samples, groups, plan, graphs[family], mesh)
            else:
                model = apply_family(_gpt2(spec), family, plan, graphs[family], mesh)
            # Re-price the plan with the compute slowed by the ranks running side by side for
            # as long as its step (measured by a matmul burst of that length).
            local = spec["batch"] * spec["seq"] // (1 if family == "replicated" else world_size)
            factor = measure_contention(plan.step_time, local, spec["hidden"])
            slow = contended(cost, factor)
            if family == "dp2xtp2":  # its Megatron collectives run in pairs of ranks
                tokens = spec["batch"] * spec["seq"] // 2
                pair = _in_step_collective(tokens, spec["hidden"], pairs[rank // 2])
                slow = replace(slow, alpha=slowest(pair))
            if family == "dp2xtp2":
                priced = hybrid_plan(hybrid[2], slow, 2)
            elif family == "mixed":
                graph = transformer_graph(groups, slow)
                names = [s.name for s in plan.strategies]
                picks = [[s.name for s in n.strategies].index(w)
                         for n, w in zip(graph.nodes, names, strict=True)]  # fmt: skip
                priced = evaluate(graph, picks, slow)
            else:
                priced = family_plan(family, groups, slow)
            best, median, peak = _measure(model, spec)
            rows.append((name, family, budget, factor, priced.step_time, best, median,
                         plan.memory, peak))  # fmt: skip
        if rank == 0:
            print(f"{name} P={world_size}: {cost}", flush=True)
    return rows


def main() -> None:
    """Print the table for 2 and 4 ranks."""
    from kolossos.testing.spawn import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--ranks", type=int, action="append")
    parser.add_argument("--plan", action="append", help="only these plans (e.g. mixed, dp)")
    args = parser.parse_args()
    models = args.model or list(MODELS)
    rows = []
    for world_size in args.ranks or (2, 4):
        for row in spawn(_rank, world_size, models=models, wanted=args.plan or [])[0]:
            rows.append((world_size, *row))
    print("| model | ranks | plan | budget | contention | predicted ms | fastest ms | "
          "err vs fastest | median ms | err vs median | predicted MiB | measured peak MiB | "
          "memory err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world_size, name, family, budget, slow, p_t, m_t, med, p_m, m_m in rows:
        print(
            f"| {name} | {world_size} | {family} | {budget} | {slow:.2f} | {p_t * 1e3:.2f} "
            f"| {m_t * 1e3:.2f} "
            f"| {(p_t - m_t) / m_t:+.0%} | {med * 1e3:.2f} | {(p_t - med) / med:+.0%} "
            f"| {p_m / 2**20:.3f} "
            f"| {m_m / 2**20:.3f} | {(p_m - m_m) / m_m:+.1%} |"
        )


if __name__ == "__main__":
    main()
