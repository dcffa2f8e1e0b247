"""Per-rank memory phases of the data-parallel plugins that keep whole working weights:
``TorchDDPPlugin`` and ``LowLevelZeroPlugin`` (whose optimizer the hybrid engine reuses).

* ``TorchDDPPlugin``: fp32 parameters, DDP's gradient buckets (one fp32 copy of the gradients,
  allocated at wrap time), gradients from backward to ``zero_grad``, AdamW states. ``fp16`` /
  ``bf16`` run under autocast, which keeps half-precision copies of the weights through forward
  and backward; activations are then estimated at two bytes an element (an approximation:
  autocast keeps norms and softmax in fp32).
* ``LowLevelZeroPlugin``: the flat working buffer, the gradient partition (ZeRO-2; ZeRO-1 when
  a step's backward passes are all synchronised) or ZeRO-1's full flat gradient buffer (when it
  accumulates locally, as a pipeline step's micro-batches do: from the first gradient of a
  step's backward to ``zero_grad``, through the forward passes after the first), fp32 master
  partitions (a view of the working buffer for fp32 without offload),
  AdamW states of the partition, gradient bucket buffers during backward, the fp32
  copy of the gradient partition at the step (with ``cpu_offload`` masters, states and the fp32
  gradient partition are host memory).
"""

from __future__ import annotations

from kolossos.utils.profiling.activations import ActivationBytes, activation_bytes
from kolossos.utils.profiling.layouts import Layout
from kolossos.utils.profiling.memory_phases import (
    ActivationPoints,
    Phase,
    Workload,
    activation_points,
    step_temporaries,
    tied_gradients,
    working_bytes,
)
from kolossos.utils.profiling.rank_model import RankModel
from kolossos.utils.profiling.zero_buckets import zero_buffers

__all__ = ["ddp_phases", "zero_phases", "zero_plugin_phases"]


def ddp_phases(layout: Layout, work: Workload, rank: RankModel) -> list[Phase]:
    """The phases of ``TorchDDPPlugin`` (module doc)."""
    psi, autocast = rank.numel, layout.precision != "fp32"
    act = activation_bytes(work.shape, work.batch // layout.dp * work.seq_len, 2 if autocast else 4)
    at = activation_points(act, rank, layout.checkpointing)
    held, at_embed = tied_gradients(rank, 4)
    # parameters, DDP's buckets and AdamW states live through the step; autocast adds the
    # half-precision copies of the weights from forward to the end of backward
    params = 4.0 * psi + (2.0 * psi if autocast else 0.0)
    keep = {"params": params, "buffers": 4.0 * psi, "optim": 8.0 * psi}
    return [
        Phase("loss", {**keep, "activations": at.forward, "temporary": at.loss_temporary}),
        Phase("head", {**keep, "activations": at.head, "grads": 4.0 * rank.head_numel}),
        Phase("backward", {**keep, "activations": at.inside, "temporary": act.layer_transient,
                           "grads": 4.0 * (rank.head_numel + rank.layer_numel)}),
        Phase("backward-end", {**keep, "grads": 4.0 * psi - held + at_embed,
                               "activations": at.end}),
        Phase("step", {**keep, "params": 4.0 * psi, "grads": 4.0 * psi,
                       "temporary": step_temporaries(rank.sizes, work.device)}),
    ]  # fmt: skip


def zero_phases(
    *,
    rank: RankModel,
    n: int,
    w: int,
    stage: int,
    offload: bool,
    act: ActivationBytes,
    at: ActivationPoints,
    work: Workload,
    accumulating: bool = False,
    local: bool = False,
) -> list[Phase]:
    """The phases of LowLevelZero's optimizer over ``rank``'s parameters and ``n`` ranks (the
    hybrid engine's ZeRO over its data-parallel axis too); ``accumulating``: several backward
    passes per step; ``local``: ZeRO-1 accumulates them without communication (a pipeline
    step), so its flat gradient buffer exists, and through the forward passes when
    ``accumulating``. Otherwise ZeRO-1 keeps partitions, as ZeRO-2 does."""
    if stage == 1 and not local:
        stage = 2
    padded = -(-rank.numel // n) * n
    part = padded / n
    separate_master = w != 4 or offload
    optim = (4.0 * part if separate_master else 0.0) + 8.0 * part
    # bucket buffers and the gradient partition during backward: replayed (zero_buckets); on
    # gloo with two ranks the owners receive point to point
    pairwise = work.device == "cpu" and n == 2
    buffers = zero_buffers(rank.sizes, rank.arrival, n, work.bucket_elements, stage, pairwise,
                           inside_after=rank.head_tensors + rank.block_tensors)  # fmt: skip
    flat_grads = w * padded if stage == 1 else 0.0
    before_backward = flat_grads if accumulating else 0.0  # zero_grad freed it
    store = 4.0 * part if offload else (w * part if stage == 2 else 0.0)

    def grads_at(exists: bool) -> tuple[float, float]:
        """(device, host) gradient bytes: ZeRO-1's flat buffer, the partition if it exists."""
        held = store if (exists or stage == 1) else 0.0
        return (flat_grads, held) if offload else (flat_grads + held, 0.0)

    dev_keep = {"params": float(w * padded), **({} if offload else {"optim": optim})}
    host = {"optim": optim} if offload else {}
    held, at_embed = tied_gradients(rank, w)
    # autograd's new gradient lives until it is added to the flat buffer or copied to a bucket
    new_grad = w * rank.largest
    in_block = act.layer_transient + w * rank.layer_largest + held
    fp32_grads = 4.0 * part if (w != 4 and not offload) else 0.0
    stepping = step_temporaries([part], work.device if not offload else "cpu", engine_shards=True)
    g_in, h_in = grads_at(buffers.partition_inside)
    g_end, h_end = grads_at(buffers.partition_end)
    g_all, h_all = grads_at(stage == 2)
    return [
        Phase("loss", {**dev_keep, "grads": before_backward, "activations": at.forward,
                       "temporary": at.loss_temporary}, host),
        Phase("head", {**dev_keep, "grads": before_backward, "activations": at.head,
                       "temporary": new_grad}, host),
        Phase("backward", {**dev_keep, "grads": g_in, "activations": at.inside,
                           "buffers": w * buffers.inside, "temporary": in_block},
              {**host, "grads": h_in}),
        Phase("backward-end", {**dev_keep, "grads": g_end, "buffers": w * buffers.end,
                               "activations": at.end, "temporary": max(at_embed, new_grad)},
              {**host, "grads": h_end}),
        Phase("reduce", {**dev_keep, "grads": g_all, "buffers": w * buffers.after,
                         "activations": at.end}, {**host, "grads": h_all}),
        Phase("step", {**dev_keep, "grads": g_all,
                       "temporary": fp32_grads + (0.0 if offload else stepping)},
              {**host, "grads": h_all, "temporary": stepping if offload else 0.0}),
    ]  # fmt: skip


def zero_plugin_phases(layout: Layout, work: Workload, rank: RankModel) -> list[Phase]:
    """The phases of ``LowLevelZeroPlugin`` (module doc)."""
    w = working_bytes(layout.precision)
    act = activation_bytes(work.shape, work.batch // layout.dp * work.seq_len, w)
    at = activation_points(act, rank, layout.checkpointing)
    return zero_phases(rank=rank, n=layout.dp, w=w, stage=layout.zero_stage,
                       offload=layout.offload, act=act, at=at, work=work)  # fmt: skip
