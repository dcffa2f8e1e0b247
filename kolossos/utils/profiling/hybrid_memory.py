"""Per-rank memory of ``HybridParallelPlugin``: tensor x pipeline x data parallelism.

Each rank holds the tensor-parallel shards of its pipeline stage's blocks (the first stage the
vocabulary-parallel embedding, the last the final norm and head; with tied embeddings the last
stage keeps its own copy). Activations are those of a micro-batch of ``batch / dp /
num_microbatches`` sequences with the TP / SP division of
:mod:`~kolossos.utils.profiling.activations`; under 1F1B stage ``k`` of ``p`` keeps
``min(p - k, m)`` micro-batches in flight, and from the first backward on all its gradients.

Optimizer side, by ``zero_stage`` and precision:

* 0, fp32: the user's AdamW over the shards (gradients and states fp32), DDP buckets over the
  data-parallel axis without pipeline (with a pipeline gradients are averaged through one flat
  buffer per dtype after the step's last backward);
* 0, fp16/bf16: working weights and gradients in the working dtype, fp32 masters and states,
  gradients converted to fp32 at the step;
* 1, 2: LowLevelZero over the data-parallel axis (:func:`~kolossos.utils.profiling.dp_memory.
  zero_phases`).
"""

from __future__ import annotations

from kolossos.utils.profiling.activations import ActivationBytes, activation_bytes
from kolossos.utils.profiling.dp_memory import zero_phases
from kolossos.utils.profiling.layouts import Layout
from kolossos.utils.profiling.memory_phases import (
    ActivationPoints,
    MemoryEstimate,
    Phase,
    Workload,
    activation_points,
    step_temporaries,
    tied_gradients,
    working_bytes,
)
from kolossos.utils.profiling.rank_model import RankModel, rank_models

__all__ = ["hybrid_estimate", "hybrid_stage_phases"]


def _plain_phases(
    layout: Layout, work: Workload, rank: RankModel, act: ActivationBytes, at: ActivationPoints
) -> list[Phase]:
    """zero_stage 0: DDP (or the pipeline's gradient average) over the data-parallel axis."""
    w, psi = working_bytes(layout.precision), float(rank.numel)
    ddp = layout.pp == 1 and layout.dp > 1
    masters = 4.0 * psi if w != 4 else 0.0
    keep = {"params": w * psi, "optim": masters + 8.0 * psi, "buffers": w * psi if ddp else 0.0}
    # with a pipeline, later micro-batches run with every gradient of the stage allocated
    early = w * psi if layout.pp > 1 else 0.0
    held, at_embed = tied_gradients(rank, w)
    average = w * psi if (layout.pp > 1 and layout.dp > 1) else 0.0  # the flat all-reduce
    # at the step fp16/bf16 gradients have become fp32 ones on the masters, tensor by tensor
    step_grads = 4.0 * psi
    return [
        Phase("loss", {**keep, "activations": at.forward, "grads": early,
                       "temporary": at.loss_temporary}),
        Phase("head", {**keep, "activations": at.head,
                       "grads": max(early, w * rank.head_numel)}),
        Phase("backward", {**keep, "activations": at.inside, "temporary": act.layer_transient,
                           "grads": max(early, w * (rank.head_numel + rank.layer_numel))}),
        Phase("backward-end", {**keep, "grads": w * psi - held + at_embed,
                               "activations": at.end}),
        Phase("average", {**keep, "grads": w * psi, "temporary": average}),
        Phase("step", {**keep, "grads": step_grads,
                       "temporary": step_temporaries(rank.sizes, work.device)}),
    ]  # fmt: skip


def hybrid_stage_phases(layout: Layout, work: Workload, rank: RankModel) -> list[Phase]:
    """The phases of one pipeline stage's rank."""
    w = working_bytes(layout.precision)
    m = layout.microbatches if layout.pp > 1 else 1
    tokens = work.batch // layout.dp // m * work.seq_len
    act = activation_bytes(work.shape, tokens, w, layout.tp, layout.sp)
    in_flight = min(layout.pp - rank.stage, m) if layout.pp > 1 else 1
    at = activation_points(act, rank, layout.checkpointing, in_flight, layout.pp == 1)
    if layout.zero_stage == 0:
        phases = _plain_phases(layout, work, rank, act, at)
    else:
        phases = zero_phases(rank=rank, n=layout.dp, w=w, stage=layout.zero_stage,
                             offload=layout.offload, act=act, at=at, work=work,
                             accumulating=m > 1, local=layout.pp > 1)  # fmt: skip
    if layout.pp == 1:
        return phases
    # sends are asynchronous and their tensors live until the step's last wait: each
    # micro-batch's activations to the next stage, its gradients to the previous one
    sent = (m * (not rank.has_head) + (m - 1) * (not rank.has_embed)) * act.hidden_grad
    in_step = ("loss", "head", "backward", "backward-end")
    return [
        Phase(p.name, {**p.device, "buffers": p.device.get("buffers", 0.0) + sent}, p.host)
        if p.name in in_step
        else p
        for p in phases
    ]


def hybrid_estimate(layout: Layout, work: Workload) -> MemoryEstimate:
    """The estimate of the pipeline stage with the largest peak."""
    ranks = rank_models(work.shape, layout.tp, layout.pp)
    estimates = [MemoryEstimate.of(hybrid_stage_phases(layout, work, r)) for r in ranks]
    return max(estimates, key=lambda e: e.peak)
