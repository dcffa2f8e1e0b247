"""``kolossos plan``'s engine: estimate every candidate layout, keep those that fit, pick one.

The recommendation is the layout that fits with the least communication per step, preferring,
in this order: no activation checkpointing (it recomputes the forward), no offloading (host
transfers), data parallelism alone (tensor parallelism synchronises every block, pipelines
idle in their bubble), fewer bytes sent per rank, a simpler plugin (DDP, then ZeRO, then FSDP /
Gemini, then the hybrid engine), and a lower peak.

Example:
    >>> from kolossos.utils.profiling.model_shape import load_model_shape
    >>> plan = make_plan(PlanRequest(shape=load_model_shape("gpt2-tiny"), nproc=2,
    ...                              budget=2**30, seq_len=64, batch=8, precision="fp32"))
    >>> plan.recommended.layout.plugin_call()
    'TorchDDPPlugin()'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kolossos.utils.profiling.comm_estimate import CommEstimate, comm_estimate
from kolossos.utils.profiling.estimators import bubble_fraction
from kolossos.utils.profiling.layouts import PRECISIONS, Layout, candidate_layouts
from kolossos.utils.profiling.memory_phases import DEVICES, MemoryEstimate, Workload
from kolossos.utils.profiling.model_params import count_parameters
from kolossos.utils.profiling.model_shape import ModelShape
from kolossos.utils.profiling.plugin_memory import estimate_memory

__all__ = ["LayoutEstimate", "Plan", "PlanRequest", "make_plan"]


def _positive(name: str, value: object, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; {hint}.")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan for."""

    shape: ModelShape
    """the model"""
    nproc: int
    """processes (devices) per node"""
    budget: int
    """device memory per rank, bytes"""
    seq_len: int
    """tokens per sequence"""
    batch: int
    """sequences per forward and backward over all ranks (the global batch; with gradient
    accumulation, one accumulation step's)"""
    nnodes: int = 1
    """nodes"""
    precision: str = "bf16"
    """``fp32``, ``fp16`` or ``bf16``"""
    device: str = "cuda"
    """``cuda`` (foreach AdamW, NCCL) or ``cpu`` (per-tensor AdamW, gloo)"""
    tp_size: int | None = None
    """consider only this tensor-parallel size for ``HybridParallelPlugin``"""
    pp_size: int | None = None
    """consider only this pipeline size for ``HybridParallelPlugin``"""

    def __post_init__(self) -> None:
        _positive("nproc", self.nproc, "pass the number of devices per node, e.g. --nproc 8")
        _positive("nnodes", self.nnodes, "pass the number of nodes, e.g. --nnodes 1")
        _positive("budget", self.budget, "pass the device memory per rank, e.g. 80GB")
        _positive("seq_len", self.seq_len, "pass the tokens per sequence, e.g. 2048")
        _positive("batch", self.batch, "pass the global batch in sequences, e.g. 32")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {PRECISIONS}.")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} must be one of {DEVICES}.")
        if self.shape.family != "vit" and self.seq_len > self.shape.max_positions:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the model's {self.shape.max_positions} "
                f"positions; pass a sequence length <= {self.shape.max_positions}."
            )
        world = self.nproc * self.nnodes
        for name, size, limit in (("tp", self.tp_size, self.nproc), ("pp", self.pp_size, world)):
            if size is None:
                continue
            _positive(f"{name}_size", size, f"pass a divisor of {limit}")
            if limit % size:
                where = "the processes per node (tensor parallelism stays in a node)"
                raise ValueError(
                    f"--{name} {size} does not divide {limit}, "
                    f"{where if name == 'tp' else 'the number of ranks'}; pick one of "
                    f"{[d for d in range(1, limit + 1) if limit % d == 0]}."
                )
        if self.tp_size and self.pp_size and world % (self.tp_size * self.pp_size):
            raise ValueError(
                f"--tp {self.tp_size} x --pp {self.pp_size} = {self.tp_size * self.pp_size} "
                f"does not divide the {world} ranks; choose sizes whose product divides {world}."
            )

    @property
    def world_size(self) -> int:
        """All ranks."""
        return self.nproc * self.nnodes

    def workload(self) -> Workload:
        """The :class:`~kolossos.utils.profiling.memory_phases.Workload` estimated."""
        return Workload(shape=self.shape, seq_len=self.seq_len, batch=self.batch,
                        device=self.device)  # fmt: skip


@dataclass(frozen=True)
class LayoutEstimate:
    """One candidate with its estimates."""

    layout: Layout
    memory: MemoryEstimate
    comm: CommEstimate
    fits: bool

    def tiers(self) -> tuple[bool, bool, bool]:
        """(activation checkpointing, offloading, model parallelism): each is avoided first."""
        lay = self.layout
        offloads = lay.offload or lay.offload_param or lay.placement == "auto"
        return lay.checkpointing, offloads, lay.tp * lay.pp > 1

    def sort_key(self) -> tuple[Any, ...]:
        """The recommendation order (module doc)."""
        return (*self.tiers(), round(self.comm.total), self.layout.complexity,
                self.memory.peak)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        lay = self.layout
        return {
            "layout": lay.name,
            "plugin": lay.plugin,
            "call": lay.plugin_call(),
            "booster": lay.booster_call(),
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "zero_stage": lay.zero_stage,
            "activation_checkpointing": lay.checkpointing,
            "num_microbatches": lay.microbatches if lay.pp > 1 else None,
            "bubble_fraction": bubble_fraction(lay.pp, lay.microbatches) if lay.pp > 1 else 0.0,
            "fits": self.fits,
            "memory": self.memory.as_dict(),
            "comm_bytes": self.comm.as_dict(),
        }


@dataclass(frozen=True)
class Plan:
    """The estimates, best first, and the recommendation."""

    request: PlanRequest
    estimates: list[LayoutEstimate] = field(default_factory=list)
    """fitting layouts in recommendation order, then the others by peak"""

    @property
    def fitting(self) -> list[LayoutEstimate]:
        """The layouts whose peak fits the budget."""
        return [e for e in self.estimates if e.fits]

    @property
    def recommended(self) -> LayoutEstimate | None:
        """The first fitting layout, or ``None``."""
        fitting = self.fitting
        return fitting[0] if fitting else None

    def reason(self) -> str:
        """One line saying why :attr:`recommended` was chosen."""
        best = self.recommended
        if best is None:
            return "no layout fits"
        tier = best.tiers()
        peers = [e for e in self.fitting if e.tiers() == tier]
        ckpt, offload, model_parallel = tier
        kind = "data-parallel " if not model_parallel else ""
        amount = f"{_gib(best.comm.total)}/step per rank"
        if len(peers) == 1:
            why = f"the only {kind}layout that fits ({amount} communicated)"
        else:
            why = f"the least communication ({amount}) of the {len(peers)} {kind}layouts that fit"
        if not (ckpt or offload):
            why += " without activation checkpointing or offload"
        same = [e for e in peers if e.sort_key()[:4] == best.sort_key()[:4]]
        if len(same) > 1:
            why += "; the simplest plugin of those with as little"
        notes = []
        if best.layout.pp > 1:
            bubble = bubble_fraction(best.layout.pp, best.layout.microbatches)
            notes.append(f"its pipeline idles {100 * bubble:.0f}% of a step (1F1B bubble)")
        if model_parallel and not (ckpt or offload):
            notes.append("no layout with data parallelism alone fits")
        if ckpt:
            notes.append("only layouts with activation checkpointing fit")
        elif offload:
            notes.append("only layouts that offload to the host fit without checkpointing")
        return "; ".join([why, *notes]) + "."

    def as_dict(self) -> dict[str, Any]:
        """The JSON object ``kolossos plan --json`` prints."""
        req, best = self.request, self.recommended
        return {
            "model": {
                "name": req.shape.name,
                "model_type": req.shape.model_type,
                "parameters": count_parameters(req.shape),
                "layers": req.shape.num_layers,
                "hidden": req.shape.hidden,
                "heads": req.shape.heads,
                "vocab": req.shape.vocab,
            },
            "nproc": req.nproc,
            "nnodes": req.nnodes,
            "world_size": req.world_size,
            "budget_bytes": req.budget,
            "seq_len": req.seq_len,
            "batch": req.batch,
            "precision": req.precision,
            "device": req.device,
            "recommended": best.as_dict() if best else None,
            "reason": self.reason(),
            "layouts": [e.as_dict() for e in self.estimates],
        }


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def make_plan(request: PlanRequest) -> Plan:
    """Estimate every candidate layout of ``request`` and rank them.

    Raises:
        ValueError: no layout is possible (the batch does not divide over the ranks).
    """
    work = request.workload()
    shape = request.shape
    layouts = candidate_layouts(shape, request.nproc, request.nnodes, request.batch,
                                request.precision)  # fmt: skip
    if request.tp_size or request.pp_size:
        layouts = [
            lay
            for lay in layouts
            if lay.plugin != "hybrid"
            or ((request.tp_size or lay.tp) == lay.tp and (request.pp_size or lay.pp) == lay.pp)
        ]
    if not layouts:
        raise ValueError(
            f"no layout divides a global batch of {request.batch} sequences over "
            f"{request.world_size} ranks; pass --batch as a multiple of {request.world_size}."
        )
    estimates = []
    for layout in layouts:
        memory = estimate_memory(layout, work)
        comm = comm_estimate(layout, work)
        estimates.append(LayoutEstimate(layout, memory, comm, memory.peak <= request.budget))
    fitting = sorted((e for e in estimates if e.fits), key=LayoutEstimate.sort_key)
    others = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.peak)
    return Plan(request, fitting + others)
