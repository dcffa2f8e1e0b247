"""Measure the compute constants of :class:`~kolossos.auto_parallel.strategies.CostModel` on
this process: the matmul rate, the cost of one small operator and of one byte a memory-bound
operator writes, and the optimizer's cost.

Each is the fastest of a short timed loop (a few milliseconds; the run least disturbed by other
jobs on a shared machine); call them on every rank and agree on one value (e.g. the slowest)
before building the cost model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["measure_compute", "measure_optimizer"]


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
