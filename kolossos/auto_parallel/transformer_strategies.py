"""Strategies for the operators of a transformer (from :func:`~kolossos.auto_parallel.
module_graph.build_module_graph`) and the :class:`~kolossos.auto_parallel.sharding_graph.
ShardingGraph` they form.

Per operator kind, on a 1-d mesh of ``P`` ranks (layouts ``B`` batch-, ``F`` feature/head/
vocabulary-sharded, ``R`` replicated; memory at the end of forward = 4 × parameter bytes held
(parameter, last step's gradient, two Adam states) + activation bytes held; at the end of
backward, ``end_mem`` = 4 × parameter bytes held plus, under ``dp``, the gradients' flat
all-reduce buffer):

* ``input``: ``B`` or ``R`` (free);
* ``embedding`` reading token ids: ``dp`` (B→B, gradient all-reduce — under data
  parallelism every gradient goes through one flat all-reduce: each operator is charged its
  bytes and the copies in and out, the loss in ``B`` the one latency), ``rep`` (R→R),
  ``vocab`` (R→R, table split over the vocabulary, forward all-reduce of the output); a
  position embedding (reads no activation): ``dp`` (gradient all-reduce) or ``rep``;
* ``linear`` (``nn.Linear``, ``Conv1D``): ``dp``, ``col`` (R→F), ``row`` (F→R), ``rep`` as in
  :func:`~kolossos.auto_parallel.strategies.strategies_for`; a weight tied to an earlier
  operator (GPT-2's ``lm_head``) holds no parameter memory and all-reduces nothing of its own;
* ``conv`` (``nn.Conv1d/2d/3d``): ``dp`` (B→B, weight replicated, gradient all-reduce),
  ``col`` (R→F, output channels sharded, the input's gradient all-reduced in backward) and
  ``rep`` (R→R), priced like the linear's;
* ``layernorm``: ``B`` (gradient all-reduce) or ``R``; ``token_params`` (ViT's CLS token and
  position embeddings, added to the patch embeddings): the same two;
* ``batchnorm``: ``B`` (gradient all-reduce, and synchronised statistics as one process's
  on the whole batch: two small all-reduces forward — per-channel sums with the count, then
  the sums of squared deviations — and one backward), ``R``, or ``F`` (channels sharded with
  their weights and running statistics: per-channel statistics, exact);
* ``attention`` and ``elementwise`` (activations; per-channel pooling): ``B``, ``R`` or ``F``
  (heads / features / channels sharded), compute divided by ``P`` when sharded;
* ``add`` (residual): both inputs and the output in one layout;
* ``loss`` (sink): logits and labels ``B`` or ``R``, or ``F`` logits (vocabulary-parallel cross
  entropy, three small all-reduces per step) with ``R`` labels;
* sequence-sharded ``Q`` (each rank a contiguous part of the sequence, every batch row) for
  operators that keep the sequence as its own dimension (``OperatorGroup.seq_ok``: LLaMA's
  ``nn.Linear`` on ``[batch, seq, hidden]``, not GPT-2's ``Conv1D``, which flattens batch and
  sequence into rows): ``linear`` ``sp`` (Q→Q, weights whole, gradient all-reduce like
  ``dp``), ``layernorm`` ``Q`` (the same), ``elementwise``/``add`` ``Q``, ``attention`` ``Q``
  (this rank's queries over every key: keys and values all-gathered along the sequence
  forward and their gradients reduce-scattered backward, priced as two all-gathers of two
  thirds of the bytes it reads — q, k and v of one size). A layout change to or from ``Q`` is
  priced as any other (``reshard_cost``: all-gather to ``R``, all-to-all to ``B``/``F``).

Activation bytes are what the operator's nodes keep alive for backward (see
:mod:`~kolossos.auto_parallel.saved_activations`), divided by ``P`` in a sharded layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from kolossos.auto_parallel.module_graph import OperatorGroup
from kolossos.auto_parallel.sharding_graph import DagNode, ShardingGraph, layout_strategies
from kolossos.auto_parallel.strategies import CostModel, Layout, Strategy

__all__ = [
    "MEGATRON_ROLES",
    "TIED_PAIRS",
    "megatron_assignment",
    "megatron_names",
    "transformer_graph",
]

_STATE_COPIES = 4.0
"""Parameter, gradient, exp_avg and exp_avg_sq at the end of forward: in the usual loop
(forward, ``zero_grad``, backward, step) the last step's gradients live until ``zero_grad``."""

MEGATRON_ROLES = {"c_attn": "col", "c_fc": "col", "q_proj": "col", "k_proj": "col",
                  "v_proj": "col", "up_proj": "col", "gate_proj": "col", "c_proj": "row",
                  "o_proj": "row", "down_proj": "row", "lm_head": "col", "fc1": "col",
                  "fc2": "row"}  # fmt: skip
"""Megatron's role of a linear by its module's last name (GPT-2, LLaMA, ViT's MLP ``fc1`` /
``fc2``); other linears (ViT's classifier) are replicated."""


TIED_PAIRS = {"dp": ("dp",), "rep": ("rep",), "vocab": ("col",)}
"""A tied weight's owner strategy (the embedding) → the strategies its other user (the lm
head) may take: the same storage and gradient synchronisation (data parallel with data
parallel, replicated with replicated, the vocabulary split with the column split), so that
the owner's price of the weight is its whole price."""


def megatron_names(group: OperatorGroup) -> set[str]:
    """The strategy names of ``group`` in the Megatron plan (GPT-2 / LLaMA / ViT naming)."""
    if group.kind == "linear":
        return {MEGATRON_ROLES.get(group.path.rsplit(".", 1)[-1], "rep")}
    if group.kind == "conv":
        return {"rep"}  # ViT's patch embedding, replicated as ShardFormer's ViT policy does
    if group.kind == "embedding":
        return {"vocab"} if group.inputs else {"rep"}
    if group.kind in ("attention", "elementwise"):
        return {"F"}
    if group.kind == "loss":
        return {"F"}
    return {"R"}


def megatron_assignment(groups: Sequence[OperatorGroup]) -> list[set[str]]:
    """The Megatron plan's strategy names for every operator of ``groups`` (in order): as
    :func:`megatron_names`, except that a two-input ``add``/``mul`` of operators both sharded
    ``F`` (LLaMA's ``act_fn(gate_proj) * up_proj``) stays ``F``, and the loss is ``F``
    (vocabulary-parallel) only on sharded logits (``R`` after ViT's replicated classifier);
    inputs are ``R``."""
    sharded: set[str] = set()
    result = []
    for group in groups:
        if group.kind == "input":
            wanted = {"R"}
        elif group.kind == "add" and group.inputs and sharded.issuperset(group.inputs):
            wanted = {"F"}
        elif group.kind == "loss" and group.inputs and group.inputs[0] not in sharded:
            wanted = {"R"}
        else:
            wanted = megatron_names(group)
        if wanted & {"col", "F"}:
            sharded.add(group.name)
        result.append(wanted)
    return result


def _strategies(group: OperatorGroup, cost: CostModel) -> list[Strategy]:
    p = float(cost.world_size)
    params, acts = group.param_bytes, group.act_bytes
    result: list[Strategy] = []

    def add(
        name: str,
        layouts: Sequence[Layout],
        out: Layout,
        *,
        flop_div: float = 1.0,
        comm_s: float = 0.0,
        comm_bytes: float = 0.0,
        param_div: float = 1.0,
        act_div: float = 1.0,
        param: float = params,
    ) -> None:
        held = param / param_div
        step = cost.optimizer(group.param_tensors, held) if held else 0.0
        # End of backward: parameter, gradient, two Adam states; under data parallelism also
        # the gradient's place in the flat all-reduce buffer.
        flat = held if name in ("dp", "B", "sp", "Q") and cost.world_size > 1 else 0.0
        result.append(
            Strategy(
                name=name,
                in_layout=layouts[0] if layouts else out,
                out_layout=out,
                in_layouts=tuple(layouts) if len(layouts) > 1 else (),
                compute_s=cost.compute(group.flops / flop_div)
                + group.ops * cost.op_s
                + cost.op_byte_s * group.op_bytes / act_div
                + step,
                comm_s=comm_s,
                comm_bytes=comm_bytes,
                param_mem=_STATE_COPIES * param / param_div,
                act_mem=acts / act_div,
                end_mem=4 * held + flat,
            )
        )

    # Data parallel: the gradients are copied into one flat buffer, all-reduced together and
    # copied back; each operator pays its bytes, the loss the one latency (a tied weight at its
    # owner).
    synced = params
    grad_sync = (
        cost.ring_bytes(synced) + 2 * cost.copy_byte_s * synced
        if synced and cost.world_size > 1
        else 0.0
    )
    n_in = len(group.inputs)
    kind = group.kind
    if kind == "embedding" and n_in:
        add("dp", ["B"], "B", comm_s=grad_sync, comm_bytes=params, act_div=p)
        add("rep", ["R"], "R")
        out = group.out_bytes
        add("vocab", ["R"], "R", comm_s=cost.all_reduce(out), comm_bytes=out, param_div=p)
    elif kind == "embedding":
        add("dp", [], "B", comm_s=grad_sync, comm_bytes=params)
        add("rep", [], "R")
    elif kind in ("linear", "conv"):
        # a convolution as a linear over channels: dp, col (output channels), rep; no row
        src = group.in_bytes[group.inputs[0]]
        weight = params - group.bias_bytes
        add("dp", ["B"], "B", flop_div=p, comm_s=grad_sync, comm_bytes=synced, act_div=p)
        add("col", ["R"], "F", flop_div=p, comm_s=cost.all_reduce(src), comm_bytes=src,
            param_div=p, act_div=p)  # fmt: skip
        out = group.out_bytes
        if kind == "linear":
            add("row", ["F"], "R", flop_div=p, comm_s=cost.all_reduce(out), comm_bytes=out,
                param=weight / p + group.bias_bytes)  # fmt: skip
        add("rep", ["R"], "R")
        if kind == "linear" and group.seq_ok:  # tokens split by sequence, weights whole
            add("sp", ["Q"], "Q", flop_div=p, comm_s=grad_sync, comm_bytes=synced, act_div=p)
    elif kind in ("layernorm", "token_params", "batchnorm"):
        ins: list[Layout] = ["B"] if n_in else []
        stats_s = stats_bytes = 0.0
        if kind == "batchnorm" and cost.world_size > 1:
            # synchronised statistics: forward the channel sums with the count, then the sums
            # of squared deviations; backward the two per-channel gradient sums
            channels = group.bias_bytes or group.param_bytes / 2
            stats_s = (cost.all_reduce(channels + 4.0) + cost.all_reduce(channels)
                       + cost.all_reduce(2 * channels))  # fmt: skip
            stats_bytes = 4 * channels + 4.0
        add("B", ins, "B", comm_s=grad_sync + stats_s, comm_bytes=params + stats_bytes,
            act_div=p)  # fmt: skip
        add("R", ["R"] if n_in else [], "R")
        if kind == "layernorm" and group.seq_ok:
            add("Q", ["Q"], "Q", comm_s=grad_sync, comm_bytes=params, act_div=p)
        if kind == "batchnorm":
            add("F", ["F"], "F", flop_div=p, param_div=p, act_div=p)
    elif kind in ("attention", "elementwise", "add"):
        for layout in ("B", "R", "F"):
            div = 1.0 if layout == "R" else p
            add(layout, [layout] * max(n_in, 1), layout, flop_div=div, act_div=div)
        if group.seq_ok:  # token-wise operators, and attention over all-gathered keys
            kv = 2.0 / 3.0 * sum(group.in_bytes.values()) if kind == "attention" else 0.0
            kv_s = 2 * cost.all_gather(kv) if kv and p > 1 else 0.0
            add("Q", ["Q"] * max(n_in, 1), "Q", flop_div=p, act_div=p, comm_s=kv_s,
                comm_bytes=2 * kv)  # fmt: skip
    elif kind == "loss":
        latency = cost.alpha if cost.world_size > 1 else 0.0
        add("B", ["B", "B"], "B", act_div=p, comm_s=latency)
        add("R", ["R", "R"], "R")
        labels = group.in_bytes[group.inputs[1]] if n_in > 1 else 0.0
        add("F", ["F", "R"], "R", comm_s=3 * cost.all_reduce(labels), comm_bytes=3 * labels,
            act_div=p)  # fmt: skip
    else:
        raise ValueError(f"no strategies for operator kind {kind!r} ({group.name}).")
    return result


def transformer_graph(
    groups: Sequence[OperatorGroup],
    cost: CostModel,
    *,
    input_layouts: Sequence[Layout] = ("B", "R"),
) -> ShardingGraph:
    """The sharding graph of ``groups`` with every operator's strategies."""
    nodes = []
    for group in groups:
        if group.kind == "input":
            strategies = layout_strategies(input_layouts)
        else:
            strategies = _strategies(group, cost)
        nodes.append(
            DagNode(
                name=group.name,
                inputs=tuple(group.inputs),
                strategies=strategies,
                out_bytes=group.out_bytes,
                sink=group.kind == "loss",
                label=f"{group.kind} {group.module_type}".strip(),
                no_batch=group.kind == "embedding" and not group.inputs,
                tied_to=group.tied_to,
                tie_allowed=TIED_PAIRS if group.tied_to else {},
            )
        )
    return ShardingGraph(tuple(nodes))
