"""Ring self-attention (RSA), the sequence parallelism of "Sequence Parallelism: Making 4D
Parallelism Possible" (Li et al., arXiv 2105.13120).

The ``P`` ranks of a process group each hold one contiguous chunk of ``s = S / P`` tokens of every
sequence, and the query, key and value projections of that chunk. Attention needs every key and
every value, so the chunks travel around the ring (rank ``r`` sends to ``r + 1`` and receives from
``r - 1``):

* :class:`RingQK` — ``scores_r = Q_r Kᵀ`` (``[N, s, S]``): the key chunks make ``P - 1`` hops,
  and each rank fills the columns of the chunk it holds. Backward: ``dQ_r = Σ_j dscores_r[:, :,
  j] K_j`` needs the key chunks once more (``P - 1`` hops), and ``dK_j = Σ_r dscores_r[:, :, j]ᵀ
  Q_r`` sums one contribution from every rank: a ring reduce-scatter, whose partial sums make
  ``P - 1`` hops alongside the keys.
* :class:`RingAV` — ``out_r = Σ_j probs_r[:, :, j] V_j``: the value chunks make ``P - 1`` hops.
  Backward: ``dprobs_r[:, :, j] = dout_r V_jᵀ`` (the values again) and ``dV_j = Σ_r probs_r[:, :,
  j]ᵀ dout_r`` (ring reduce-scatter).

Each hop carries one ``[N, s, d]`` chunk, so one attention layer sends, per rank,
``2 (P - 1) N s d`` elements in the forward pass and ``4 (P - 1) N s d`` in the backward pass
(``N`` = batch × heads, ``d`` = head size), and no rank ever holds more than ``s × S`` scores per
``(batch, head)``. The gradients are the exact gradients of full attention (upstream Colossal-AI
divides ``dQ``, ``dK`` and ``dV`` by ``P``; kolossos does not, so a parallel run trains the same
model as one process). :class:`TransformerSelfAttentionRing` is the Megatron-style layer on them.

Example:
    >>> scores = RingQK.apply(q, k, group)       # [N, s, S]  # doctest: +SKIP
    >>> out = RingAV.apply(scores.softmax(-1), v, group)       # [N, s, d]  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import enum
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "AttnMaskType",
    "RingAV",
    "RingQK",
    "TransformerSelfAttentionRing",
    "ring_self_attention_bytes",
]

_KEYS_TAG, _PARTIAL_TAG = 0, 1  # keep the two streams of a backward hop apart on gloo


class AttnMaskType(enum.Enum):
    """Which mask the layer builds itself (Colossal-AI's ``AttnMaskType``)."""

    padding = 1
    """only the masks passed to ``forward`` (bidirectional attention)"""
    causal = 2
    """also hide every key after the query's global position"""


# --------------------------------------------------------------------------- ring plumbing
class _Ring:
    """This rank's place in the ring of ``group`` and one-hop shifts to the next rank."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        """Post ``send(tensor) → next`` and ``recv ← prev``; return the receive buffer and the
        works to wait on (the buffer is valid only after :meth:`finish`)."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return received, list(dist.batch_isend_irecv(ops))

    @staticmethod
    def finish(works: list[Any]) -> None:
        for work in works:  # SYNC POINT: the hop has arrived
            work.wait()


def _ring_pass(
    ring: _Ring,
    travelling: torch.Tensor,
    use: Callable[[int, torch.Tensor], None],
    contribution: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Show every rank's chunk of ``travelling`` to this rank: ``use(owner, chunk)`` for each
    owner in the order ``r, r - 1, ..., r + 1`` (the next hop is in flight while ``use`` runs).

    With ``contribution``, also a ring reduce-scatter: ``Σ_r contribution_r(owner)`` arrives at
    ``owner`` and is returned. At step ``t`` this rank holds the partial sum destined for rank
    ``r - t - 1``, adds its own term and passes it on; after ``P - 1`` hops its own is complete."""
    current, partial = travelling, None
    for step in range(ring.size):
        last = step == ring.size - 1
        received, works = (None, []) if last else ring.start_shift(current, _KEYS_TAG)
        use((ring.rank - step) % ring.size, current)
        received_partial = None
        if contribution is not None:
            term = contribution((ring.rank - step - 1) % ring.size)
            partial = term if partial is None else partial + term
            if not last:
                received_partial, partial_works = ring.start_shift(partial, _PARTIAL_TAG)
                works = works + partial_works
        ring.finish(works)
        if received is not None:
            current = received
        if received_partial is not None:
            partial = received_partial
    return partial


def _columns(owner: int, chunk: int) -> slice:
    return slice(owner * chunk, (owner + 1) * chunk)


def _check_chunks(name: str, a: torch.Tensor, b: torch.Tensor, names: str, same: bool) -> None:
    """Shape checks, before any communication."""
    keep = 3 if same else 1  # compare whole shapes, or the batch*heads dimension only
    if a.dim() != 3 or b.dim() != 3 or a.shape[:keep] != b.shape[:keep]:
        what = "shape" if same else "batch*heads"
        raise ValueError(
            f"{name} takes 3-D [batch*heads, sub_seq, ...] {names} with the same {what}; got "
            f"{tuple(a.shape)} and {tuple(b.shape)}."
        )


# --------------------------------------------------------------------------- autograd functions
class RingQK(torch.autograd.Function):
    """``Q_r Kᵀ`` for this rank's queries and all keys, the keys passed around the ring.

    ``RingQK.apply(sub_q, sub_k, group)``: ``sub_q`` and ``sub_k`` are ``[N, s, d]`` (this rank's
    chunk of ``s`` tokens, ``N`` = batch × heads); returns the scores ``[N, s, P·s]``, whose
    column block ``j`` belongs to rank ``j``'s keys. Every rank of ``group`` must call it with
    chunks of the same shape.
    """

    @staticmethod
    def forward(
        ctx: Any, sub_q: torch.Tensor, sub_k: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        _check_chunks("RingQK", sub_q, sub_k, "sub_q, sub_k", True)
        ring = _Ring(group)
        chunk = sub_k.shape[1]
        scores = sub_q.new_empty(sub_q.shape[0], sub_q.shape[1], chunk * ring.size)

        def use(owner: int, keys: torch.Tensor) -> None:
            scores[:, :, _columns(owner, chunk)] = torch.bmm(sub_q, keys.transpose(1, 2))

        _ring_pass(ring, sub_k, use)
        ctx.save_for_backward(sub_q, sub_k)
        ctx.group = group
        return scores

    @staticmethod
    def backward(ctx: Any, grad_scores: torch.Tensor) -> tuple[Any, ...]:
        sub_q, sub_k = ctx.saved_tensors
        ring = _Ring(ctx.group)
        chunk = sub_k.shape[1]
        grad_q = torch.zeros_like(sub_q)

        def use(owner: int, keys: torch.Tensor) -> None:
            grad_q.add_(torch.bmm(grad_scores[:, :, _columns(owner, chunk)], keys))

        def contribution(owner: int) -> torch.Tensor:
            return torch.bmm(grad_scores[:, :, _columns(owner, chunk)].transpose(1, 2), sub_q)

        return grad_q, _ring_pass(ring, sub_k, use, contribution), None


class RingAV(torch.autograd.Function):
    """``Σ_j probs_r[:, :, j] V_j`` for this rank's query rows, the values passed around the
    ring.

    ``RingAV.apply(attention_probs, sub_v, group)``: ``attention_probs`` is ``[N, s, P·s]`` (as
    :class:`RingQK` returns it, after softmax), ``sub_v`` is ``[N, s, d]``; returns ``[N, s, d]``.
    """

    @staticmethod
    def forward(
        ctx: Any, attention_probs: torch.Tensor, sub_v: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        _check_chunks("RingAV", attention_probs, sub_v, "attention_probs, sub_v", False)
        ring = _Ring(group)
        chunk = sub_v.shape[1]
        if attention_probs.shape[2] != chunk * ring.size:
            raise ValueError(
                f"RingAV: attention_probs has {attention_probs.shape[2]} key columns; with "
                f"sub_v's {chunk} tokens on each of {ring.size} ranks it must have "
                f"{chunk * ring.size}."
            )
        out = attention_probs.new_zeros(attention_probs.shape[0], attention_probs.shape[1],
                                        sub_v.shape[2])  # fmt: skip

        def use(owner: int, values: torch.Tensor) -> None:
            out.add_(torch.bmm(attention_probs[:, :, _columns(owner, chunk)], values))

        _ring_pass(ring, sub_v, use)
        ctx.save_for_backward(attention_probs, sub_v)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        attention_probs, sub_v = ctx.saved_tensors
        ring = _Ring(ctx.group)
        chunk = sub_v.shape[1]
        grad_out = grad_out.contiguous()
        grad_probs = torch.empty_like(attention_probs)

        def use(owner: int, values: torch.Tensor) -> None:
            grad_probs[:, :, _columns(owner, chunk)] = torch.bmm(grad_out, values.transpose(1, 2))

        def contribution(owner: int) -> torch.Tensor:
            cols = _columns(owner, chunk)
            return torch.bmm(attention_probs[:, :, cols].transpose(1, 2), grad_out)

        return grad_probs, _ring_pass(ring, sub_v, use, contribution), None


def ring_self_attention_bytes(
    batch_heads: int, sub_seq: int, head_size: int, world_size: int, element_size: int = 4
) -> dict[str, int]:
    """Closed form of the bytes one rank sends (and receives) for one :class:`RingQK` plus one
    :class:`RingAV` call: ``{"forward": 2 (P-1) N s d e, "backward": 4 (P-1) N s d e}``."""
    hop = batch_heads * sub_seq * head_size * element_size
    return {"forward": 2 * (world_size - 1) * hop, "backward": 4 * (world_size - 1) * hop}


# --------------------------------------------------------------------------- the layer
def default_attention_mask_func(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hide the positions where ``mask`` is True (the dtype's lowest value, so that a row with
    every key hidden gives a uniform distribution instead of NaN)."""
    return scores.masked_fill(mask, torch.finfo(scores.dtype).min)


MaskFunc = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _gather_key_padding(mask: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``[b, s]`` key-padding chunk, concatenated to ``[b, P·s]`` (a collective)."""
    is_bool = mask.dtype == torch.bool
    local = (mask.to(torch.uint8) if is_bool else mask.detach()).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)  # SYNC POINT
    full = torch.cat(parts, dim=1)
    return full.bool() if is_bool else full


class TransformerSelfAttentionRing(nn.Module):
    """Self-attention over a sequence split across the ranks of ``group`` (ring self-attention).

    Colossal-AI's layer: ``forward`` takes this rank's chunk ``[sub_seq, batch, hidden]`` (rank
    ``j`` holds tokens ``j·s ... (j+1)·s - 1``) and returns ``(output without the dense bias,
    dense bias)``. Every rank holds all parameters: average their gradients over the ranks that
    share them (``SequenceParallelGradientHandler``, or DDP).

    Args:
        hidden_size: model width; divisible by ``num_attention_heads``.
        num_attention_heads: number of heads.
        attention_dropout: dropout probability on the attention probabilities.
        attention_mask_func: ``f(scores, mask) -> scores`` applied with boolean masks (True =
            hidden); default: fill with the dtype's lowest value.
        layer_number: this layer's 1-based index (the scaling coefficient below).
        apply_query_key_layer_scaling: divide the scores by ``layer_number`` more before the
            softmax and multiply back inside it (fp16 range); implies
            ``convert_fp16_to_fp32_in_softmax``.
        convert_fp16_to_fp32_in_softmax: run the softmax of fp16/bf16 scores in fp32.
        attn_mask_type: :attr:`AttnMaskType.padding` (bidirectional) or
            :attr:`AttnMaskType.causal` (hide keys after the query's global position).
        masked_softmax_fusion: Colossal-AI's CUDA kernel switch; kolossos always uses PyTorch's
            softmax, which computes the same function, so the flag selects nothing.
        fp16, bf16: the scores' dtype (Colossal-AI's flags; kolossos reads the dtype; not both).
        group: the sequence-parallel process group (keyword-only, required).
        device, dtype: of the parameters.

    Raises:
        ValueError: a size, probability or flag combination out of range.
        TypeError: ``group`` is not a process group, or ``attn_mask_type`` not an AttnMaskType.

    Example:
        >>> attn = TransformerSelfAttentionRing(64, 4, 0.0, group=seq_group)  # doctest: +SKIP
        >>> out, bias = attn(x_chunk, key_padding_mask=pad_chunk)  # x_chunk: [s, b, 64]
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        attention_dropout: float = 0.0,
        attention_mask_func: MaskFunc | None = None,
        layer_number: int = 1,
        apply_query_key_layer_scaling: bool = False,
        convert_fp16_to_fp32_in_softmax: bool = False,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        masked_softmax_fusion: bool = True,
        fp16: bool = False,
        bf16: bool = False,
        *,
        group: dist.ProcessGroup,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _validate(hidden_size, num_attention_heads, attention_dropout, layer_number, fp16, bf16)
        if not isinstance(attn_mask_type, AttnMaskType):
            raise TypeError(f"attn_mask_type={attn_mask_type!r} must be an AttnMaskType.")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup (the sequence-parallel group), "
                f"got {type(group).__name__}; in the legacy API use "
                "kolossos.legacy.nn.layer.parallel_sequence.TransformerSelfAttentionRing."
            )
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.masked_softmax_fusion = masked_softmax_fusion
        self.apply_query_key_layer_scaling = apply_query_key_layer_scaling
        self.convert_fp16_to_fp32_in_softmax = (
            convert_fp16_to_fp32_in_softmax or apply_query_key_layer_scaling
        )
        self.attention_mask_func: MaskFunc = attention_mask_func or default_attention_mask_func
        self.coeff: float | None = float(layer_number) if apply_query_key_layer_scaling else None
        # the standard 1/sqrt(head size) (upstream divides by sqrt(hidden_size))
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head) * (self.coeff or 1.0)
        factory = {"device": device, "dtype": dtype}
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size, **factory)  # type: ignore[arg-type]
        self.attention_dropout = nn.Dropout(attention_dropout)
        self.dense = nn.Linear(hidden_size, hidden_size, **factory)  # type: ignore[arg-type]
        self.reset_parameters()

    def __deepcopy__(self, memo: dict[int, Any]) -> TransformerSelfAttentionRing:
        """A copy that shares the process group (a group cannot be copied or pickled)."""
        memo.setdefault(id(self.group), self.group)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def reset_parameters(self) -> None:
        """Colossal-AI's initialisation: Xavier-normal weights, zero biases."""
        for linear in (self.query_key_value, self.dense):
            nn.init.xavier_normal_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend this rank's queries to every rank's keys (collective over ``group``).

        Args:
            hidden_states: ``[sub_seq, batch, hidden]``, this rank's chunk.
            attention_mask: for this rank's query rows and all keys, broadcastable to ``[batch,
                heads, sub_seq, seq]``: boolean (True = hidden, Colossal-AI's convention) or
                additive float.
            key_padding_mask: this rank's keys, ``[batch, sub_seq]``: boolean (True = padding,
                as ``nn.MultiheadAttention``) or additive float; gathered over ``group``.

        Returns:
            ``(output [sub_seq, batch, hidden] without the dense bias, dense bias)``.
        """
        sub_seq, batch = self._check_input(hidden_states)
        seq = sub_seq * self.world_size
        heads, head_size = self.num_attention_heads, self.hidden_size_per_attention_head
        _check_masks(attention_mask, key_padding_mask, (batch, heads, sub_seq, seq))
        mixed = self.query_key_value(hidden_states).view(sub_seq, batch, heads, 3 * head_size)
        query, key, value = (_batch_heads_first(t) for t in mixed.split(head_size, dim=-1))
        scores = RingQK.apply(query, key, self.group) / self.norm_factor
        scores = scores.view(batch, heads, sub_seq, seq)
        probs = self._softmax(scores, *self._masks(attention_mask, key_padding_mask, sub_seq))
        probs = self._dropout(probs).view(batch * heads, sub_seq, seq)
        context = RingAV.apply(probs, value, self.group)  # [b*heads, s, d]
        context = context.view(batch, heads, sub_seq, head_size).permute(2, 0, 1, 3)
        context = context.reshape(sub_seq, batch, self.hidden_size)
        return F.linear(context, self.dense.weight), self.dense.bias

    # ------------------------------------------------------------------ pieces
    def _check_input(self, hidden_states: torch.Tensor) -> tuple[int, int]:
        if hidden_states.dim() != 3 or hidden_states.shape[2] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [sub_seq, batch, {self.hidden_size}] (sequence first); "
                f"got {tuple(hidden_states.shape)}."
            )
        return hidden_states.shape[0], hidden_states.shape[1]

    def _masks(
        self, attention_mask: torch.Tensor | None, key_padding: torch.Tensor | None, sub_seq: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(boolean mask, additive mask)``, each broadcastable to the scores or ``None``."""
        hidden: list[torch.Tensor] = []
        additive: list[torch.Tensor] = []
        for mask in (attention_mask, key_padding):
            if mask is None:
                continue
            if mask is key_padding:
                mask = _gather_key_padding(mask, self.group)[:, None, None, :]
            (hidden if mask.dtype == torch.bool else additive).append(mask)
        if self.attn_mask_type is AttnMaskType.causal:
            device = (attention_mask if attention_mask is not None else self.dense.weight).device
            start = dist.get_rank(self.group) * sub_seq
            queries = torch.arange(start, start + sub_seq, device=device)
            keys = torch.arange(sub_seq * self.world_size, device=device)
            hidden.append(keys[None, :] > queries[:, None])
        bool_mask = functools.reduce(torch.logical_or, hidden) if hidden else None
        return bool_mask, functools.reduce(torch.add, additive) if additive else None

    def _softmax(
        self, scores: torch.Tensor, hidden: torch.Tensor | None, additive: torch.Tensor | None
    ) -> torch.Tensor:
        """Colossal-AI's scale-mask-softmax, unfused."""
        dtype = scores.dtype
        to_fp32 = self.convert_fp16_to_fp32_in_softmax and dtype in (torch.float16, torch.bfloat16)
        if to_fp32:
            scores = scores.float()
        if self.coeff is not None:
            scores = scores * self.coeff
        if additive is not None:
            scores = scores + additive.to(scores.dtype)
        if hidden is not None:
            scores = self.attention_mask_func(scores, hidden)
        probs = torch.softmax(scores, dim=-1)
        return probs.to(dtype) if to_fp32 else probs

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        """Attention dropout (the legacy layer draws it from ``ParallelMode.TENSOR``'s stream)."""
        return self.attention_dropout(probs)

    def extra_repr(self) -> str:
        names = ("hidden_size", "num_attention_heads", "world_size", "layer_number")
        fields = [f"{n}={getattr(self, n)}" for n in names]
        return ", ".join([*fields, f"attn_mask_type={self.attn_mask_type.name}"])


def _batch_heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, heads, d]`` → ``[b·heads, s, d]`` (contiguous, the ring's chunk layout)."""
    s, b, h, d = t.shape
    return t.reshape(s, b * h, d).transpose(0, 1).contiguous()


def _validate(hidden: int, heads: int, dropout: float, layer: int, fp16: bool, bf16: bool) -> None:
    for name, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                        ("layer_number", layer)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1.")
    if hidden % heads:
        raise ValueError(
            f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; pick a head "
            "count that divides the hidden size."
        )
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"attention_dropout={dropout!r} must be in [0, 1).")
    if fp16 and bf16:
        raise ValueError("fp16=True and bf16=True: the scores have one dtype; set at most one.")


def _check_masks(
    attention_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    scores_shape: tuple[int, int, int, int],
) -> None:
    """Mask shapes, before any communication."""
    batch, _, sub_seq, _ = scores_shape
    if attention_mask is not None:
        try:
            ok = torch.broadcast_shapes(attention_mask.shape, scores_shape) == scores_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} does not broadcast to the scores "
                f"[batch, heads, sub_seq, seq] = {list(scores_shape)}: pass this rank's query rows "
                "against every key, e.g. [batch, 1, sub_seq, seq]."
            )
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, sub_seq):
        raise ValueError(
            f"key_padding_mask {tuple(key_padding_mask.shape)} must be this rank's keys "
            f"[batch, sub_seq] = [{batch}, {sub_seq}]."
        )
