"""Bytes one rank sends per training step under a layout, with bandwidth-optimal (ring)
collectives (:func:`~kolossos.utils.profiling.estimators.collective_sent_bytes`), the figure
NCCL's algorithms reach; plus the bytes moved between host and device by offloading.

* data parallelism: DDP all-reduces the fp32 gradients; ZeRO-1/2 reduce the gradients to their
  owners and all-gather the updated weights (both in the working dtype); Gemini and FSDP
  all-gather the weights for forward and again for backward (not when they stay gathered:
  FSDP's ``SHARD_GRAD_OP``, Gemini's chunks held between forward and backward) and
  reduce-scatter the gradients (FSDP in fp32);
* tensor parallelism: per block and micro-batch two all-reduces of the hidden states in forward
  and two in backward (sequence parallelism: the same bytes as all-gathers and
  reduce-scatters), one more for the vocabulary-parallel embedding and one for the head;
  checkpointing repeats the forward's;
* pipeline parallelism: the activations of each micro-batch to the next stage and their
  gradients back (a middle stage sends both).

Example:
    >>> from kolossos.utils.profiling.layouts import Layout
    >>> from kolossos.utils.profiling.memory_phases import Workload
    >>> from kolossos.utils.profiling.model_shape import load_model_shape
    >>> work = Workload(shape=load_model_shape("gpt2-tiny"), seq_len=64, batch=8)
    >>> comm_estimate(Layout(plugin="ddp", precision="fp32", dp=2), work).data_parallel
    2668544.0
"""

from __future__ import annotations

from dataclasses import dataclass

from kolossos.utils.profiling.estimators import collective_sent_bytes, comm_volume_elements
from kolossos.utils.profiling.layouts import Layout
from kolossos.utils.profiling.memory_phases import Workload, working_bytes
from kolossos.utils.profiling.rank_model import rank_models
from kolossos.utils.profiling.sharded_memory import chunk_sizes

__all__ = ["CommEstimate", "comm_estimate"]


@dataclass(frozen=True, kw_only=True)
class CommEstimate:
    """Bytes one rank sends per step (the busiest rank), by kind of parallelism."""

    data_parallel: float
    tensor_parallel: float
    pipeline: float
    offload: float
    """bytes between host and device memory (not network traffic)"""

    @property
    def total(self) -> float:
        """Bytes sent over the network: data, tensor and pipeline parallelism."""
        return self.data_parallel + self.tensor_parallel + self.pipeline

    def as_dict(self) -> dict[str, float]:
        """A JSON-ready dict."""
        return {
            "data_parallel": self.data_parallel,
            "tensor_parallel": self.tensor_parallel,
            "pipeline": self.pipeline,
            "offload": self.offload,
            "total": self.total,
        }


def _data_parallel(layout: Layout, psi: float, chunks: int) -> tuple[float, float]:
    """(network, host<->device) bytes of the data-parallel part for ``psi`` local elements."""
    n, w = layout.dp, working_bytes(layout.precision)
    send = lambda kind, nbytes: collective_sent_bytes(kind, nbytes, n)  # noqa: E731
    elements = round(psi)
    if layout.plugin == "ddp":  # fp32 gradients, also under autocast
        return 4.0 * comm_volume_elements(elements, "ddp", n), 0.0
    if layout.plugin == "gemini":
        # one gather per pass; with at most three chunks they stay gathered into backward
        gathers = 1 if (not layout.shard_params or chunks <= 3) else 2
        if not layout.shard_params:  # kept gathered: refreshed after the step
            gathers = 1
        network = gathers * send("all_gather", w * psi) + send("reduce_scatter", w * psi)
        host = (4.0 + w) * psi / n if (layout.offload or layout.placement == "auto") else 0.0
        return network, host
    if layout.plugin == "fsdp":
        gathers = 2 if layout.reshard else 1
        network = gathers * send("all_gather", w * psi) + send("reduce_scatter", 4.0 * psi)
        return network, (4.0 + w) * psi / n if layout.offload else 0.0
    if layout.zero_stage == 0:  # hybrid without ZeRO: gradients averaged in the working dtype
        return w * comm_volume_elements(elements, "ddp", n), 0.0
    network = w * comm_volume_elements(elements, f"zero{layout.zero_stage}", n)
    return network, (4.0 + w) * psi / n if layout.offload else 0.0


def comm_estimate(layout: Layout, work: Workload) -> CommEstimate:
    """The :class:`CommEstimate` of training ``work`` with ``layout``."""
    shape, w = work.shape, working_bytes(layout.precision)
    ranks = rank_models(shape, layout.tp, layout.pp)
    worst = max(ranks, key=lambda r: r.numel)
    chunks = (len(chunk_sizes(worst.sizes, layout.dp, alone=worst.tied_index))
              if layout.plugin == "gemini" else 0)  # fmt: skip
    dp, offload = _data_parallel(layout, float(worst.numel), chunks)
    m = layout.microbatches if layout.pp > 1 else 1
    tokens = work.batch // layout.dp // m * work.seq_len
    hidden = tokens * shape.hidden * w  # one micro-batch's hidden states
    tp = 0.0
    if layout.tp > 1:
        per_block = 4 + (2 if layout.checkpointing else 0)
        collectives = m * (max(r.layers for r in ranks) * per_block + 2)
        tp = collectives * collective_sent_bytes("all_reduce", hidden, layout.tp)
    pp = 0.0
    if layout.pp > 1:
        pp = (2 if layout.pp > 2 else 1) * m * hidden
    return CommEstimate(data_parallel=dp if layout.dp > 1 else 0.0, tensor_parallel=tp,
                        pipeline=pp, offload=offload)  # fmt: skip
