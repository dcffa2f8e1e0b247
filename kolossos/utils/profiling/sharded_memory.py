"""Per-rank memory phases of the ZeRO-3 plugins: ``GeminiPlugin`` (chunks) and
``TorchFSDPPlugin`` (FSDP2 units).

* **Gemini** packs the parameters, in registration order, into chunks (the same chunk-size search
  as :func:`kolossos.zero.gemini.chunk.find_chunk_configuration`: a model under
  ``min_chunk_size_m`` = 32 Mi elements is one chunk, a tied embedding is alone in a chunk).
  Per chunk of ``C`` elements a rank keeps its fp32 master and AdamW states (``12 C / N``);
  while the chunk is in use the full payload in the working dtype (``W C``) and, for fp16/bf16,
  a working copy of its shard (``W C / N``); during backward its gradients are written over that
  payload (a kept-gathered chunk's into a full gradient payload of their own, ``W C``) until
  they are complete, then an fp32 gradient shard (``4 C / N``) until the step. A tied LM head
  keeps the embedding's chunk gathered, and its gradients unreduced, from the head's use to the
  embedding's. From the end of forward to the start of backward only the head's chunks are
  gathered (nothing is prefetched over the loss).
* **FSDP2** shards fp32 parameters (``4 Ψ / N``), fp32 gradients (``4 Ψ / N``, reduced in fp32)
  and AdamW states; each block is a unit gathered in the working dtype for its forward and again
  for its backward (the next one prefetched), the root unit (embeddings, final norm, head) stays
  gathered from its forward to the end of backward; each unit's gradients are reduce-scattered
  through an fp32 copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kolossos.utils.profiling.activations import activation_bytes
from kolossos.utils.profiling.layouts import Layout
from kolossos.utils.profiling.memory_phases import (
    Phase,
    Workload,
    activation_points,
    step_temporaries,
    tied_gradients,
    working_bytes,
)
from kolossos.utils.profiling.rank_model import RankModel

__all__ = ["chunk_sizes", "fsdp_phases", "gemini_phases", "search_chunk_size"]

_MI = 2**20


def search_chunk_size(
    numels: Sequence[int], search_range: int = 32 * _MI, min_chunk: int = 32 * _MI,
    interval: int = 1024, alone: int = -1,
) -> int:  # fmt: skip
    """Gemini's chunk size for tensors of ``numels`` elements: the size in ``[min_chunk,
    min_chunk + search_range]`` (step ``interval``) wasting the fewest elements at chunk ends,
    the smallest on a tie; everything in one chunk when it fits in ``min_chunk``. The tensor at
    index ``alone`` (a tied embedding) closes the open chunk and has one of its own."""
    total = sum(numels)
    if total <= min_chunk:
        return max(total, 1)
    sizes = np.arange(min_chunk, min_chunk + search_range + 1, interval, dtype=np.int64)
    left = np.zeros_like(sizes)
    waste = np.zeros_like(sizes)
    for i, n in enumerate(numels):
        if i == alone:
            waste += left
            left = np.zeros_like(sizes)
            continue
        fits = left >= n
        waste += np.where(fits, 0, left)
        left = np.where(fits, left - n, np.where(sizes < n, 0, sizes - n))
    return int(sizes[int(np.argmin(waste))])


def chunk_sizes(
    numels: Sequence[int], world_size: int, chunk_size: int | None = None, alone: int = -1
) -> list[int]:
    """The chunks' sizes (elements, multiples of ``world_size``) Gemini's chunk manager builds:
    tensors packed in order, a tensor larger than a chunk in a chunk of its own, the tensor at
    index ``alone`` (a tied embedding) alone in a chunk cut to its size, the last chunk cut to
    what it holds."""
    up = lambda v: -(-v // world_size) * world_size  # noqa: E731
    searched = search_chunk_size(numels, alone=alone) if chunk_size is None else chunk_size
    size = up(max(searched, 1))
    groups: list[int] = []
    cut: list[bool] = []
    room = 0
    for i, n in enumerate(numels):
        if i == alone or n > room or not groups:
            groups.append(0)
            cut.append(i == alone)
            room = max(size, n)
        groups[-1] += n
        room = 0 if i == alone else room - n
    if cut:
        cut[-1] = True
    return [up(used) if to_content else max(up(used), size)
            for used, to_content in zip(groups, cut, strict=True)]  # fmt: skip


def gemini_phases(layout: Layout, work: Workload, rank: RankModel) -> list[Phase]:
    """The phases of ``GeminiPlugin`` (module doc; ``auto`` is modelled as static placement with
    everything but the chunks in use on the host)."""
    n, w = layout.dp, working_bytes(layout.precision)
    chunks = chunk_sizes(rank.sizes, n, alone=rank.tied_index)
    psi, biggest = float(sum(chunks)), sorted(chunks, reverse=True)
    act = activation_bytes(work.shape, work.batch // n * work.seq_len, w)
    at = activation_points(act, rank, layout.checkpointing)
    host_optim = layout.offload or layout.placement == "auto"
    # a sharded chunk in use has a working copy of its shard unless the fp32 master on the
    # compute device serves as one; a kept-gathered chunk's shard is a view of its payload
    cache = layout.shard_params and (w != 4 or (host_optim and work.device != "cpu"))
    in_use = sum(biggest[:3]) if layout.shard_params else psi  # current, prefetched, held
    gathered = w * in_use + (w * in_use / n if cache else 0.0)
    optim = 12.0 * psi / n
    keep: dict[str, float] = {"params": gathered, **({} if host_optim else {"optim": optim})}
    # from the end of forward to backward's first use only the head's chunks stay gathered (a
    # tied head's weight is in the first chunk; BERT's decoder bias, like an untied head, in the
    # last); backward prefetches its next chunk once it starts
    last = {len(chunks) - 1}
    head = ({0} | (last if work.shape.family == "bert" else set())) if rank.tied_numel else last
    held_chunks = sum(chunks[i] for i in head)
    # (the working copies of the shards of every chunk forward used stay until their reduction)
    at_loss = w * held_chunks + (w * psi / n if cache else 0.0) if layout.shard_params else gathered
    host: dict[str, float] = {"optim": optim} if host_optim else {}
    held, at_embed = tied_gradients(rank, w)
    # the gradient payload of the chunk being filled: its own gathered payload when sharded
    payload = 0.0 if layout.shard_params else w * biggest[0]
    # backward ends in the first chunk (the embeddings'): the others are reduced to shards
    first = chunks[0]
    first_gathered = w * first + (w * first / n if cache else 0.0) if layout.shard_params else 0.0
    end_params = first_gathered if layout.shard_params else gathered
    shards = 4.0 * psi / n  # fp32 gradient shards, from reduction to the step
    others = shards - 4.0 * first / n
    payload_first = 0.0 if layout.shard_params else w * first
    # the reduce-scatter's output while the chunk's payload, and the gradient whose arrival
    # completed the chunk (the hook's argument), are still alive; a low-precision output is then
    # copied to the chunk's fp32 gradient shard (a kept-gathered chunk's own gradient payload is
    # freed by then)
    reduce_tmp = w * first / n + w * rank.largest
    made = 4.0 * first / n if w != 4 else 0.0
    dev_shards, host_shards = (0.0, shards) if host_optim else (shards, 0.0)
    dev_others, host_others = (0.0, others) if host_optim else (others, 0.0)
    # at the reduction: (device grads, host grads)
    reduce_grads = ((payload_first, others + made) if host_optim
                    else (max(payload_first, made) + others, 0.0))  # fmt: skip
    on_host = host_optim or work.device == "cpu"
    stepping = step_temporaries([biggest[0] / n] if on_host else [c / n for c in chunks],
                                "cpu" if on_host else "cuda", engine_shards=True)  # fmt: skip
    end_keep = {**keep, "params": end_params}
    return [
        Phase("loss", {**keep, "params": at_loss, "activations": at.forward,
                       "temporary": at.loss_temporary}, host),
        Phase("head", {**keep, "activations": at.head, "temporary": w * rank.largest}, host),
        Phase("backward", {**keep, "grads": payload, "activations": at.inside,
                           "temporary": act.layer_transient + w * rank.layer_largest + held},
              host),
        Phase("backward-end", {**end_keep, "grads": payload_first + dev_others,
                               "activations": at.end,
                               "temporary": max(at_embed, w * rank.largest)},
              {**host, "grads": host_others}),
        Phase("reduce", {**end_keep, "grads": reduce_grads[0], "activations": at.end,
                         "temporary": reduce_tmp}, {**host, "grads": reduce_grads[1]}),
        Phase("step", {**keep, "params": 0.0 if layout.shard_params else w * psi,
                       "grads": dev_shards, "temporary": 0.0 if host_optim else stepping},
              {**host, "grads": host_shards, "temporary": stepping if host_optim else 0.0}),
    ]  # fmt: skip


def fsdp_phases(layout: Layout, work: Workload, rank: RankModel) -> list[Phase]:
    """The phases of ``TorchFSDPPlugin`` (module doc)."""
    n, w = layout.dp, working_bytes(layout.precision)
    psi = float(rank.numel)
    act = activation_bytes(work.shape, work.batch // n * work.seq_len, w, output_fp32=w != 4)
    at = activation_points(act, rank, layout.checkpointing)
    root = float(rank.embed_numel + rank.head_numel - (rank.tied_numel if rank.has_embed else 0))
    unit = float(rank.layer_numel)
    units = 2 * unit if layout.reshard else rank.layers * unit  # current and prefetched
    # FSDP2 keeps the last block gathered from its forward into backward
    after_forward = unit if layout.reshard else rank.layers * unit
    sharded = {"params": 4.0 * psi / n, "optim": 8.0 * psi / n}
    dev_keep = {} if layout.offload else dict(sharded)
    host = dict(sharded) if layout.offload else {}
    shards = 4.0 * psi / n
    dev_shards, host_shards = (0.0, shards) if layout.offload else (shards, 0.0)
    held, at_embed = tied_gradients(rank, w)
    # a unit's gradients: unsharded in the working dtype, an fp32 copy for the reduce-scatter
    reduce_unit = w * unit + 4.0 * unit * (1 + 1 / n)
    root_grads = w * root - held + at_embed
    reduce_root = w * root + 4.0 * root * (1 + 1 / n)
    stepping = step_temporaries([s / n for s in rank.sizes],
                                "cpu" if layout.offload else work.device)  # fmt: skip
    base = dev_keep.get("params", 0.0)
    return [
        Phase("loss", {**dev_keep, "params": base + w * (root + after_forward),
                       "activations": at.forward, "temporary": at.loss_temporary}, host),
        Phase("head", {**dev_keep, "params": base + w * (root + after_forward),
                       "activations": at.head, "grads": w * rank.head_numel}, host),
        Phase("backward", {**dev_keep, "params": base + w * (root + units),
                           "activations": at.inside, "temporary": act.layer_transient,
                           "grads": w * rank.head_numel + reduce_unit}, host),
        Phase("backward-end", {**dev_keep, "params": base + w * root,
                               "grads": dev_shards + max(root_grads, reduce_root),
                               "activations": at.end},
              {**host, "grads": host_shards}),
        Phase("step", {**dev_keep, "grads": dev_shards,
                       "temporary": 0.0 if layout.offload else stepping},
              {**host, "grads": host_shards, "temporary": stepping if layout.offload else 0.0}),
    ]  # fmt: skip
