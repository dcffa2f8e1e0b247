"""A chain of stages with the costs the checkpoint search needs, and the pass that measures them.

A model is linearised into stages run one after the other (transformer blocks, residual blocks; the
last stage may end in the loss). For each stage the search needs its forward time, the activation
bytes it keeps for backward, and the transient peaks of its forward and backward. On the CPU the
bytes come from :class:`~kolossos.accelerator.TensorMemoryTracker` (exact tensor accounting), so the
figures are measurements, not estimates.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kolossos.accelerator import ACTIVATIONS, TensorMemoryTracker

__all__ = ["Chain", "Stage", "activation_bytes", "profile_chain"]


@dataclass(frozen=True, kw_only=True)
class Stage:
    """The measured costs of one stage of a chain (bytes exclude parameters and their grads)."""

    name: str
    """A label for printouts (the module's name in the chain)."""
    forward_time: float
    """Seconds of one forward of the stage: the price of recomputing it."""
    saved_bytes: int
    """Activation bytes alive after a grad-mode forward, the stage's output included."""
    output_bytes: int
    """Bytes of the stage's output (what a checkpointed segment ending here keeps)."""
    forward_peak_bytes: int
    """Peak activation bytes during the forward, above the bytes alive before it."""
    backward_peak_bytes: int
    """Peak activation bytes from the start of backward (output grad included) above the bytes
    alive before the stage's forward, minus ``saved_bytes``: the extra the backward needs."""

    def __post_init__(self) -> None:
        for name in ("saved_bytes", "output_bytes", "forward_peak_bytes", "backward_peak_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Stage {self.name!r}: {name}={getattr(self, name)} must be >= 0.")
        if self.forward_time < 0:
            raise ValueError(f"Stage {self.name!r}: forward_time={self.forward_time} must be >= 0.")


@dataclass(frozen=True, kw_only=True)
class Chain:
    """The stages of a linearised model, in execution order."""

    stages: tuple[Stage, ...]
    """One entry per stage."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("Chain needs at least one stage.")

    def __len__(self) -> int:
        return len(self.stages)


def activation_bytes(tracker: TensorMemoryTracker, when: str = "current") -> int:
    """Bytes billed to the activations category of ``tracker`` now or at its category peak."""
    if when == "peak":
        return tracker.category_peaks().get(ACTIVATIONS, 0)
    return tracker.breakdown("current").get(ACTIVATIONS, 0)


def _measure_memory(stage: torch.nn.Module, x: torch.Tensor) -> tuple[int, int, int, int]:
    """(saved, output, forward peak, backward extra) bytes of ``stage`` run on ``x``."""
    with TensorMemoryTracker(x.device) as tracker:
        tracker.track(stage)
        with tracker.category(ACTIVATIONS):
            out = stage(x)
            saved = activation_bytes(tracker)
            forward_peak = activation_bytes(tracker, "peak")
            out.backward(torch.ones_like(out))
            total_peak = activation_bytes(tracker, "peak")
        output = out.numel() * out.element_size()
    return saved, output, forward_peak, max(total_peak - saved, 0)


def _measure_time(stage: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            stage(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_chain(
    stages: Sequence[torch.nn.Module],
    sample_input: torch.Tensor,
    *,
    names: Sequence[str] | None = None,
    repeats: int = 3,
) -> Chain:
    """Measure each stage of ``stages`` run one after the other on ``sample_input``.

    The parameters' gradients are left as they were. Dropout should be off (``eval()`` or p=0)
    for the recomputation to reproduce the forward exactly.

    Args:
        stages: the modules of the chain; each takes the previous one's single tensor output.
        sample_input: the first stage's input (a real tensor: the pass runs the model).
        names: labels of the stages (default: their indices).
        repeats: forward timings per stage; the median is kept.

    Returns:
        The measured :class:`Chain`.

    Raises:
        ValueError: no stages, or ``names`` of the wrong length.
    """
    if not stages:
        raise ValueError("profile_chain needs at least one stage.")
    labels = list(names) if names is not None else [str(i) for i in range(len(stages))]
    if len(labels) != len(stages):
        raise ValueError(f"names has {len(labels)} entries for {len(stages)} stages.")
    params = [p for stage in stages for p in stage.parameters()]
    grads = [p.grad for p in params]
    measured = []
    x = sample_input.detach()
    for label, stage in zip(labels, stages, strict=True):
        x_in = x.requires_grad_(x.is_floating_point())
        saved, output, fpeak, bextra = _measure_memory(stage, x_in)
        seconds = _measure_time(stage, x_in.detach(), repeats)
        measured.append(
            Stage(
                name=label,
                forward_time=seconds,
                saved_bytes=saved,
                output_bytes=output,
                forward_peak_bytes=fpeak,
                backward_peak_bytes=bextra,
            )
        )
        with torch.no_grad():
            x = stage(x_in.detach()).detach()
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return Chain(stages=tuple(measured))
