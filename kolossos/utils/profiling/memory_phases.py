"""The moments of a training step at which a rank's memory can peak, and what is alive at each.

A plugin's estimate (:mod:`~kolossos.utils.profiling.plugin_memory`) lists :class:`Phase`\\ s:
the end of forward, the start of backward (the loss's gradients), inside the first block's
backward, the end of backward, and the optimizer step, each with the bytes alive per category on
the device and on the host. The peak is the largest phase; :class:`MemoryEstimate` keeps it,
where it happens, and each category's own largest value.

Example:
    >>> est = MemoryEstimate.of([Phase("forward", {"params": 10.0, "activations": 5.0}),
    ...                          Phase("step", {"params": 10.0, "optim": 20.0})])
    >>> est.peak, est.peak_phase, est.activations
    (30.0, 'step', 5.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kolossos.utils.profiling.activations import ActivationBytes
from kolossos.utils.profiling.model_shape import ModelShape
from kolossos.utils.profiling.rank_model import RankModel

__all__ = [
    "CATEGORIES",
    "DEVICES",
    "ActivationPoints",
    "MemoryEstimate",
    "Phase",
    "Workload",
    "activation_points",
    "step_temporaries",
    "tied_gradients",
    "working_bytes",
]

#: devices whose optimizer paths are modelled (``cuda``: foreach AdamW; ``cpu``: per tensor)
DEVICES = ("cuda", "cpu")
#: what the bytes are: working parameters (gathered copies included), gradients, optimizer
#: states with fp32 masters, kept activations, communication buffers, short-lived temporaries
CATEGORIES = ("params", "grads", "optim", "activations", "buffers", "temporary")


@dataclass(frozen=True)
class Phase:
    """Bytes alive at one moment of the step, per category."""

    name: str
    device: dict[str, float]
    host: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in (*self.device, *self.host):
            assert key in CATEGORIES, key

    @property
    def device_total(self) -> float:
        """Device bytes at this moment."""
        return sum(self.device.values())

    @property
    def total(self) -> float:
        """Device and host bytes at this moment."""
        return self.device_total + sum(self.host.values())


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Estimated memory of one rank over a training step (bytes)."""

    peak: float
    """device bytes at the largest moment"""
    peak_phase: str
    """that moment: ``forward``, ``loss``, ``backward``, ``backward-end`` or ``step``"""
    peak_total: float
    """device plus host bytes at their largest moment (what one CPU process holds)"""
    host: float
    """the most host bytes at any moment (offloaded states)"""
    params: float
    """the most device bytes of working parameters (gathered copies included)"""
    grads: float
    """the most device bytes of gradients"""
    optim: float
    """the most device bytes of optimizer states and fp32 master weights"""
    activations: float
    """the most device bytes of activations kept for backward"""
    buffers: float
    """the most device bytes of communication buffers"""
    temporary: float
    """the most device bytes of short-lived temporaries"""
    at_peak: dict[str, float] = field(default_factory=dict)
    """the categories at the peak"""

    @classmethod
    def of(cls, phases: Sequence[Phase]) -> MemoryEstimate:
        """The estimate of a list of phases."""
        top = max(phases, key=lambda p: p.device_total)
        biggest = {c: max(p.device.get(c, 0.0) for p in phases) for c in CATEGORIES}
        return cls(
            peak=top.device_total,
            peak_phase=top.name,
            peak_total=max(p.total for p in phases),
            host=max(sum(p.host.values()) for p in phases),
            at_peak={c: top.device.get(c, 0.0) for c in CATEGORIES},
            **biggest,
        )

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return {
            "peak": self.peak,
            "peak_phase": self.peak_phase,
            "peak_total": self.peak_total,
            "host": self.host,
            **{c: getattr(self, c) for c in CATEGORIES},
        }


def step_temporaries(sizes: Sequence[float], device: str, engine_shards: bool = False) -> float:
    """Bytes of AdamW's temporaries while stepping fp32 tensors of ``sizes`` elements.

    On CUDA ``torch.optim.AdamW`` takes the ``foreach`` path: one fp32 copy of every stepped
    tensor at once (the square root of the second moments). On the CPU it steps tensor by
    tensor, with two temporaries of the tensor's size at a time, except the ZeRO engines'
    shards (``engine_shards``), which it steps with its fused kernel
    (:mod:`kolossos.nn.optimizer.fused_step`): no temporaries.
    """
    if not sizes or (engine_shards and device == "cpu"):
        return 0.0
    if device == "cuda":
        return 4.0 * sum(sizes)
    return 2 * 4.0 * max(sizes)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained: the model, the sequence length and the global batch."""

    shape: ModelShape
    """the model"""
    seq_len: int
    """tokens per sequence"""
    batch: int
    """sequences per forward and backward over all data-parallel ranks"""
    device: str = "cuda"
    """``cuda`` or ``cpu`` (:data:`DEVICES`): which optimizer and collective paths run"""
    bucket_elements: int = 12 * 2**20
    """LowLevelZero's ``reduce_bucket_size_in_m`` in elements"""


def working_bytes(precision: str) -> int:
    """Bytes per element of the working dtype: 4 for fp32, 2 for fp16/bf16."""
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class ActivationPoints:
    """Activation bytes at the moments of a step on one rank."""

    forward: float
    """kept at the end of forward (the loss computed)"""
    loss_temporary: float
    """on top of ``forward`` while the loss is computed and its backward starts: the fp32
    copies of low-precision logits, then the loss's gradients (minus the logits when nothing
    holds them, as in a pipeline schedule)"""
    head: float
    """kept while the output head runs its backward: the loss's tensors replaced by the logits'
    gradient and the gradient of the head's input"""
    inside: float
    """kept inside the last block's backward: the logits (when the model's output holds them),
    the blocks' tensors and, under checkpointing, the recomputed block"""
    end: float
    """kept at the end of backward: the embeddings' tensors and the held logits"""


def activation_points(
    act: ActivationBytes,
    rank: RankModel,
    checkpointing: bool,
    in_flight: int = 1,
    output_held: bool = True,
) -> ActivationPoints:
    """The :class:`ActivationPoints` of ``rank`` with ``in_flight`` micro-batches alive;
    ``output_held``: the training loop keeps the model's output (and so the logits) through
    backward, as ``out = model(...); booster.backward(out.loss, optimizer)`` does."""
    forward = act.kept(rank.layers, checkpointing, rank.has_embed, rank.has_head)
    per_layer = act.layer_checkpointed if checkpointing else act.layer
    dropped = 0.0 if output_held else rank.has_head * act.logits
    inside = rank.has_embed * act.embed + rank.layers * per_layer + rank.has_head * act.logits
    if checkpointing and rank.layers:
        inside += act.layer
    head = forward - rank.has_head * (act.loss_kept - act.logits_grad - act.hidden_grad) - dropped
    loss_t = max(act.forward_transient, act.loss_transient - dropped) if rank.has_head else 0.0
    earlier = (in_flight - 1) * forward
    end = rank.has_embed * act.embed + rank.has_head * act.logits - dropped
    return ActivationPoints(
        earlier + forward, loss_t, earlier + head, earlier + inside - dropped, earlier + end
    )


def tied_gradients(rank: RankModel, grad_bytes: float) -> tuple[float, float]:
    """A tied embedding's gradient bytes on ``rank``: ``(held, at the embedding)``. Autograd
    holds the output head's contribution from the head's backward until the embedding's
    backward adds its own (the new one and the sum are alive with it for a moment), and only
    then is the parameter's gradient final. ``(0, 0)`` without a tied embedding on ``rank``."""
    if not (rank.has_embed and rank.tied_numel):
        return 0.0, 0.0
    one = grad_bytes * rank.tied_numel
    return one, 3 * one
