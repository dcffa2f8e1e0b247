"""Measure the compute constants of :class:`~kolossos.auto_parallel.strategies.CostModel` on
this process: the matmul rate, the cost of one small operator and of one byte a memory-bound
operator writes, and the optimizer's cost; and, over the ranks, how much slower they compute
side by side than alone (:func:`measure_contention`, applied with :func:`contended`).

Each per-process constant is the fastest of a short timed loop (a few milliseconds; the run
least disturbed by other jobs on a shared machine); call them on every rank and agree on one
value (:func:`slowest`) before building the cost model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from kolossos.auto_parallel.strategies import CostModel

__all__ = [
    "calibrate_contention",
    "check_contention",
    "contended",
    "measure_compute",
    "measure_contention",
    "measure_optimizer",
    "slowest",
]


def _fastest(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.out_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not out._is_view():
            self.out_bytes += out.numel() * out.element_size()
        return out


def _forward_ops(x: torch.Tensor, module: torch.nn.Module) -> int:
    return _forward_count(x, module).ops


def _forward_count(x: torch.Tensor, module: torch.nn.Module) -> _Count:
    with torch.no_grad(), _Count() as count:
        module(x)
    return count


class _MemoryBound(torch.nn.Module):
    """GELU (tanh), LayerNorm and a residual add: memory-bound operators of a transformer."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.act = torch.nn.GELU(approximate="tanh")
        self.norm = torch.nn.LayerNorm(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(x)) + x


def measure_compute(tokens: int, hidden: int, repeats: int = 15) -> dict[str, float]:
    """``flops_per_s`` (a ``tokens x hidden`` by ``hidden x 4·hidden`` linear, forward and
    backward, as 3 × the forward FLOPs), ``op_s`` (the forward + backward cost of one small
    operator — module call, dispatch, autograd — from a stack of tiny ``Linear``/``GELU``/
    ``LayerNorm`` modules, divided by the ATen operators its forward runs) and ``op_byte_s``
    (tanh-GELU, LayerNorm and an add on a ``tokens x 4·hidden`` tensor, forward and backward,
    less ``op_s`` per operator, per byte their forward writes)."""
    x = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(4 * hidden, hidden, requires_grad=True)

    def linear() -> None:
        torch.nn.functional.linear(x, w).sum().backward()

    # A stack of tiny modules: its step time is almost all per-operator cost (module call,
    # dispatch, autograd), divided by the forward operators it runs.
    stack = torch.nn.Sequential(
        *(
            m
            for _ in range(4)
            for m in (torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
        )
    )
    tiny_x = torch.randn(2, 8)

    def tiny() -> None:
        stack(tiny_x).sum().backward()

    op_s = _fastest(tiny, repeats * 2) / _forward_ops(tiny_x, stack)
    matmul_s = max(_fastest(linear, repeats) - 3 * op_s, 1e-9)
    # Memory-bound operators at the MLP's activation size: the time beyond their dispatch
    # cost, per byte their forward writes.
    bound = _MemoryBound(4 * hidden)
    big_x = torch.randn(tokens, 4 * hidden, requires_grad=True)

    def memory_bound() -> None:
        bound(big_x).sum().backward()

    count = _forward_count(big_x, bound)
    bound_s = _fastest(memory_bound, repeats) - count.ops * op_s
    return {
        "flops_per_s": 3 * 2 * tokens * hidden * 4 * hidden / matmul_s,
        "op_s": op_s,
        "op_byte_s": max(bound_s, 0.0) / count.out_bytes,
    }


def measure_optimizer(repeats: int = 15) -> dict[str, float]:
    """Adam's ``step`` cost: ``tensor_s`` per parameter tensor and ``byte_s`` per parameter byte
    (from steps over 16 small and over 2 large tensors); ``copy_byte_s``, the cost of one byte
    copied into a flat buffer and back."""

    def step_time(shapes: list[tuple[int, ...]]) -> float:
        params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.Adam(params, lr=1e-3)
        return _fastest(opt.step, repeats)

    small = step_time([(4,)] * 16) / 16
    big_shape = (256, 256)
    big = step_time([big_shape] * 2) / 2
    byte_s = max(big - small, 0.0) / (256 * 256 * 4)
    chunks = [torch.randn(256, 256) for _ in range(4)]
    flat = torch.cat([c.reshape(-1) for c in chunks])

    def copy() -> None:  # into a flat buffer and back, as the data-parallel all-reduce does
        torch.cat([c.reshape(-1) for c in chunks], out=flat)
        for i, c in enumerate(chunks):
            c.copy_(flat[i * c.numel() : (i + 1) * c.numel()].view_as(c))

    copy_byte_s = _fastest(copy, repeats) / (2 * flat.numel() * 4)
    return {"tensor_s": small, "byte_s": byte_s, "copy_byte_s": copy_byte_s}


def slowest(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest ``value`` over the ranks of ``group`` (the slowest rank sets the step;
    COLLECTIVE)."""
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor)


def check_contention(factor: float) -> None:
    """Raise ``ValueError`` unless ``factor`` (side-by-side time / alone time) is at least 1."""
    if not factor >= 1.0:
        raise ValueError(
            f"contention={factor!r} must be >= 1 (the ranks' compute time side by side / "
            "alone); pass 1.0 for none."
        )


def contended(cost: CostModel, factor: float) -> CostModel:
    """``cost`` with every compute constant ``factor`` times slower: the matmul rate, the
    per-operator and per-byte operator costs, the optimizer's and the flat-buffer copy's (CPU
    work too). The communication constants (``alpha``, ``beta``) are unchanged.

    Raises:
        ValueError: ``factor`` below 1.
    """
    check_contention(factor)
    return replace(
        cost,
        flops_per_s=cost.flops_per_s / factor,
        op_s=cost.op_s * factor,
        op_byte_s=cost.op_byte_s * factor,
        optimizer_tensor_s=cost.optimizer_tensor_s * factor,
        optimizer_byte_s=cost.optimizer_byte_s * factor,
        copy_byte_s=cost.copy_byte_s * factor,
    )


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_contention(
    seconds: float, tokens: int, hidden: int, repeats: int = 7, time_limit_s: float | None = None
) -> float:
    """How much slower the ranks of the default group compute side by side than alone, for
    work lasting about ``seconds`` alone (at least 1; COLLECTIVE: every rank calls it).

    The work is synthetic, a mix like a training step's: a ``Linear(hidden, 4·hidden)``,
    tanh-GELU and ``LayerNorm`` forward + backward on ``tokens`` rows, repeated to last
    ``seconds`` (at least once; the repetitions are counted from the fastest of 5 timed after
    a barrier). Each of ``repeats`` trials times it alone on every rank in turn and then on all
    ranks at once (after a barrier; the slowest rank); the factor is the median together over
    the slowest rank's median alone. It takes about ``repeats × (world size + factor) ×
    seconds``; with ``time_limit_s`` it stops after the first trial that ends past that many
    seconds from the start (the ranks agree; at least one trial). More ranks than cores, or
    virtual cores sharing a physical one, raise it.
    """
    start = time.perf_counter()
    block = torch.nn.Sequential(
        torch.nn.Linear(hidden, 4 * hidden),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.LayerNorm(4 * hidden),
    )
    x = torch.randn(max(1, tokens), hidden, requires_grad=True)

    def once() -> None:
        block(x).sum().backward()

    once()
    one = []
    for _ in range(5):
        dist.barrier()
        one.append(_timed(once))
    count = max(1, round(slowest(seconds / max(min(one), 1e-9))))

    def work() -> None:
        for _ in range(count):
            once()

    alone: list[float] = []
    together: list[float] = []
    for _ in range(repeats):
        for turn in range(dist.get_world_size()):
            dist.barrier()
            if dist.get_rank() == turn:
                alone.append(_timed(work))
            dist.barrier()
        together.append(slowest(_timed(work)))
        if time_limit_s is not None and slowest(time.perf_counter() - start) > time_limit_s:
            break
    alone_s = max(slowest(statistics.median(alone)), 1e-9)
    return max(1.0, statistics.median(together) / alone_s)


PROBE_HIDDEN = 1024
"""Largest ``hidden`` of :func:`calibrate_contention`'s work (its weight: 16 MiB)."""
PROBE_FLOPS = 2e8
"""Largest forward + backward FLOPs of one repetition of :func:`calibrate_contention`'s work."""


def calibrate_contention(tokens: int, hidden: int, time_s: float = 1.0, repeats: int = 5) -> float:
    """:func:`measure_contention` within about ``time_s`` seconds: work of
    ``time_s / (repeats × (world size + 2))`` seconds per timing (room for a factor of 2), no
    trial started after ``time_s``, and the work's shape capped (``hidden`` at
    :data:`PROBE_HIDDEN`, the rows to :data:`PROBE_FLOPS` per repetition) so that one
    repetition of a large model's shape cannot outlast the bound (COLLECTIVE)."""
    hidden = max(1, min(int(hidden), PROBE_HIDDEN))
    rows = max(1, min(int(tokens), int(PROBE_FLOPS / (24 * hidden**2))))
    seconds = time_s / (repeats * (dist.get_world_size() + 2))
    return measure_contention(seconds, rows, hidden, repeats, time_limit_s=time_s)
