"""Predicted vs measured step time and peak memory of ``autoparallelize`` plans on CPU ranks.

Run ``python -m benchmarks.auto_parallel`` (spawns gloo ranks on this machine). Each rank
measures its matmul rate and the gloo all-reduce latency/bandwidth, builds a :class:`CostModel`
from them, solves the best data-parallel and the best tensor-parallel plan of a 4-layer MLP
(marking the one :func:`autoparallelize` would choose without a budget), then times training
steps (forward, backward, Adam; median) and measures the peak tensor memory of one step with
:class:`~kolossos.accelerator.TensorMemoryTracker`. Prints one table row per case.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from kolossos.auto_parallel.apply import AutoParallelModule

__all__ = ["main"]

HIDDEN = 128
BATCH = 256
STEPS = 8


def _mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(4):
        layers.append(nn.Linear(HIDDEN, HIDDEN))
        if i < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _median_time(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _alpha_beta(world_size: int) -> tuple[float, float]:
    # The large message is of the size the plans move (64 KiB), where gloo's cost is measured.
    small, large = torch.zeros(1), torch.zeros(HIDDEN * HIDDEN)
    alpha = _median_time(lambda: dist.all_reduce(small), 20)
    t_large = _median_time(lambda: dist.all_reduce(large), 20)
    volume = 2 * (world_size - 1) / world_size * large.numel() * 4
    return alpha, max(t_large - alpha, 0.0) / volume


def _measure(model: AutoParallelModule) -> tuple[float, float]:
    """Median step time (forward, backward, Adam) and the peak tensor bytes of one step."""
    from kolossos.accelerator import TensorMemoryTracker

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)
    xs, ys = model.local_batch(x), model.local_batch(y)

    def step() -> None:
        loss = nn.functional.mse_loss(model(xs), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    measured = _median_time(step, STEPS)
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model, opt)
        tracker.reset_peak()
        step()
    return measured, float(tracker.peak_bytes)


def _rank(rank: int, world_size: int, port: int) -> list[tuple[str, float, float, float, float]]:
    import kolossos
    from kolossos.auto_parallel import CostModel
    from kolossos.auto_parallel.apply import apply_plan
    from kolossos.auto_parallel.auto_mesh import resolve_mesh
    from kolossos.auto_parallel.autoparallelize import (
        build_chain,
        measure_flops_rate,
        search_plan,
    )
    from kolossos.auto_parallel.solver import (
        DATA_PARALLEL,
        TENSOR_PARALLEL,
        ChainNode,
        solve_chain,
    )

    kolossos.launch(
        config={},
        rank=rank,
        world_size=world_size,
        host="127.0.0.1",
        port=port,
        backend="gloo",
        seed=0,
        verbose=False,
    )
    alpha, beta = _alpha_beta(world_size)
    rate = torch.tensor(measure_flops_rate(HIDDEN, 9))
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    cost = CostModel(world_size=world_size, flops_per_s=float(rate), alpha=alpha, beta=beta)
    meta = {"input": torch.empty(BATCH, HIDDEN, device="meta")}
    chain, targets = build_chain(_mlp(), meta, cost)
    mesh = resolve_mesh(None).flat
    chosen = search_plan(chain, cost).names
    rows = []
    # The Megatron plan without the replicated-linear option, to time column/row sharding too.
    megatron = [
        ChainNode(
            name=n.name,
            in_bytes=n.in_bytes,
            strategies=[s for s in n.strategies if s.name != "rep"],
        )
        for n in chain
    ]
    cases = ((chain, DATA_PARALLEL), (chain, TENSOR_PARALLEL), (megatron, TENSOR_PARALLEL))
    for nodes, family in cases:
        plan = solve_chain(nodes, cost, allowed_layouts=family, input_layouts=family[:1])
        model = apply_plan(_mlp(), plan, mesh, targets)
        measured, peak = _measure(model)
        name = "/".join(dict.fromkeys(n for n in plan.names if len(n) > 1))
        if plan.names == chosen:
            name += " (chosen)"
        rows.append((name, plan.step_time, measured, plan.memory, peak))
    return rows


def main() -> None:
    """Print the table for 2 and 4 ranks."""
    from kolossos.testing.spawn import spawn

    print(f"MLP 4 x Linear({HIDDEN}, {HIDDEN}), batch {BATCH}, fp32, Adam, gloo CPU ranks")
    print("| ranks | plan | predicted ms | measured ms | predicted MiB | measured peak MiB |")
    print("|---|---|---|---|---|---|")
    for world_size in (2, 4):
        rows = spawn(_rank, world_size)[0]
        for plan, p_time, m_time, p_mem, m_mem in rows:
            print(
                f"| {world_size} | {plan} | {p_time * 1e3:.2f} | {m_time * 1e3:.2f} | "
                f"{p_mem / 2**20:.3f} | {m_mem / 2**20:.3f} |"
            )


if __name__ == "__main__":
    main()
