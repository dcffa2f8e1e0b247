"""One rank's measurement of one layout: build the MLP, run the warm-up steps, time the profiled
steps, then run one accounting step under the memory meter and the traffic counter.

The accounting step is separate because both instruments intercept every operator: timing them
would time the instruments. A step is a forward, ``out.mean().backward()`` (Colossal-AI's
benchmark step; the input requires a gradient, as inside a model) and, for data parallel,
DDP's gradient all-reduce; gradients are dropped after
every step, so each starts from the same state and the accounting step is the steady state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kolossos.accelerator import get_accelerator
from kolossos.cli.benchmark.layouts import Layout
from kolossos.cli.benchmark.model import MLP, make_input, split_input
from kolossos.cli.benchmark.options import BenchmarkOptions
from kolossos.utils.profiling.comm_counter import CommCounter
from kolossos.utils.profiling.memory import MemoryMeter

__all__ = ["RankMeasurement", "measure_layout"]


@dataclass
class RankMeasurement:
    """What one rank measured for one layout (seconds and bytes)."""

    forward_s: list[float] = field(default_factory=list)
    """Forward time of each profiled step."""
    backward_s: list[float] = field(default_factory=list)
    """Backward time (gradient communication included) of each profiled step."""
    peak_bytes: int = 0
    """Peak memory of the accounting step: the allocator's on a GPU, every tensor storage's on
    the CPU (:class:`~kolossos.utils.profiling.memory.MemoryMeter`)."""
    memory_source: str = ""
    """``allocator`` or ``tracker``."""
    comm_bytes: int = 0
    """Logical bytes of the accounting step's collectives (:class:`CommCounter`)."""
    comm_sent_bytes: float = 0.0
    """Bytes this rank put on the wire in that step under the counter's algorithm model."""
    comm_calls: int = 0
    """Collective calls of that step."""
    error: str | None = None
    """``Type: message`` when the layout failed on this rank."""

    def as_dict(self) -> dict[str, Any]:
        """A picklable, JSON-ready copy."""
        return asdict(self)


def _build(layout: Layout, options: BenchmarkOptions) -> nn.Module:
    torch.manual_seed(options.seed)  # the same dense weights for every layout
    model: nn.Module = MLP(options.dimension, options.layers)
    if layout.mode is None:
        device = get_accelerator().get_current_device()
        ids = None if device.type == "cpu" else [device]
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model


def _inputs(layout: Layout, options: BenchmarkOptions, model: nn.Module) -> Iterator[torch.Tensor]:
    """This rank's input block of each step, drawn from the same seed on every rank."""
    mlp = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    assert isinstance(mlp, MLP)
    generator = torch.Generator().manual_seed(options.seed)
    while True:
        full = make_input(options.batch_size, options.seq_len, options.dimension, generator)
        # The MLP stands for layers inside a model, whose input gradient is needed: without it
        # a lone column-parallel layer would skip the all-reduce of its backward.
        yield split_input(full, layout, mlp).requires_grad_(True)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """One forward and backward; their times (the device synchronised around each)."""
    accelerator = get_accelerator()
    accelerator.synchronize()
    start = time.perf_counter()
    out = model(x)
    accelerator.synchronize()
    middle = time.perf_counter()
    out.float().mean().backward()
    accelerator.synchronize()
    end = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return middle - start, end - middle


def measure_layout(layout: Layout, options: BenchmarkOptions) -> RankMeasurement:
    """Measure ``layout`` on this rank. Call it on every rank after ``kolossos.launch`` with
    ``layout``'s config. COLLECTIVE (the model's own communication).

    Raises:
        Whatever building or running the model raises (the caller records it).
    """
    result = RankMeasurement()
    model = _build(layout, options)
    inputs = _inputs(layout, options, model)
    for _ in range(options.warmup_steps):
        _step(model, next(inputs))
    for _ in range(options.profile_steps):
        forward, backward = _step(model, next(inputs))
        result.forward_s.append(forward)
        result.backward_s.append(backward)
    x = next(inputs)
    dist.barrier()  # SYNC POINT: no rank's counter sees another layout's stragglers
    with MemoryMeter() as meter:
        meter.track(model, x)
        with CommCounter() as comm:
            _step(model, x)
    memory = meter.result()
    result.peak_bytes, result.memory_source = memory.peak, memory.source
    result.comm_bytes, result.comm_calls = comm.bytes(), comm.calls()
    result.comm_sent_bytes = comm.sent_bytes()
    return result
