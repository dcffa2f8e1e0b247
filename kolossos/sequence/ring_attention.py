"""Ring attention (context parallelism): exact attention over a sequence sharded across a ring of
ranks, computed block by block with an online softmax while K/V blocks travel round the ring.

**Math.** Rank ``r`` holds queries ``Q_r`` and keys/values ``K_r, V_r`` of its sequence shard. For
each block ``j`` it computes ``S = Q_r K_jᵀ·scale``, the block's log-sum-exp ``l_j = log Σ exp S``
per query and the block output ``O_j = softmax(S) V_j``, and folds it into the running
``(O, l)``: ``l' = log(eˡ + e^{l_j})``, ``O' = e^{l-l'}·O + e^{l_j-l'}·O_j``. After every block
``O`` is the exact softmax over all keys seen so far; after all ``P`` blocks it is full attention.
The backward is flash attention's, with the final ``l``: ``P_ij = exp(S_ij - l_i)``,
``dV_j = Pᵀ dO``, ``dS = P ∘ (dO V_jᵀ - δ)`` with ``δ = rowsum(dO ∘ O)``, ``dQ += dS K_j·scale``,
``dK_j = dSᵀ Q·scale`` — exact, nothing is recomputed approximately. Rows whose every key is
masked give a zero output and zero gradients (SDPA would give NaN).

**Communication** (per rank, ``N_kv = batch · kv_heads · S/P · (dim_k + dim_v) · bytes``, one
K/V block): forward ``P-1`` steps each send the held K/V block to rank ``r+1`` and receive the next
from ``r-1`` with non-blocking ``batch_isend_irecv``, started *before* the block's attention is
computed and waited after it (communication overlapped with compute): ``(P-1)·N_kv`` sent. The
backward passes K/V round again, ``(P-1)·N_kv``, plus a gradient accumulator ``(dK_j, dV_j)``
(fp32) that follows each block from its first visitor and reaches home after the last one added
to it (the owner adds its own share there): ``P-1`` hops of ``N_kv·4/bytes``. A key padding
mask travels with its keys (``batch · S/P`` bytes per hop).
:func:`ring_attention_comm_bytes` is this closed form.

**Causal load balancing.** With the contiguous split, under a causal mask rank ``P-1`` attends
to every block and rank 0 to one. With the zig-zag split (:mod:`kolossos.sequence.zigzag`, rank
``r`` holds chunks ``r`` and ``2P-1-r``) every off-diagonal step computes exactly half a block:
the query chunks that see nothing of the held block, and key chunks no query sees, are skipped.
The skipping is derived from global positions, so any layout is exact.

Example:
    >>> out = ring_attention(q, k, v, group, causal=True)  # zig-zag shards  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kolossos.cluster.collectives import comm_device
from kolossos.sequence.zigzag import LAYOUTS, Layout, sequence_segments

__all__ = ["ring_attention", "ring_attention_comm_bytes"]

_TAG_KV, _TAG_MASK, _TAG_GRAD = 0, 1, 2
_NEG_INF = float("-inf")


class _Transfer:
    """One batch of non-blocking sends to the next rank and receives from the previous one."""

    def __init__(
        self,
        works: list[Any],
        recv: list[torch.Tensor],
        keep: list[torch.Tensor],
        home: torch.device,
    ) -> None:
        self.works, self.recv, self.keep, self.home = works, recv, keep, home

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:  # SYNC POINT: this step's exchange has completed
            work.wait()
        self.keep.clear()  # the send buffers may go now
        return [t.to(self.home) for t in self.recv]


class _Ring:
    """This rank's neighbours in ``group`` and the exchange of buffers round the ring."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world, self.rank, self.next, self.prev = 1, 0, 0, 0
        self.device = torch.device("cpu")
        if not dist.is_initialized():  # one process: a ring of one, nothing is sent
            return
        ring = group if group is not None else dist.group.WORLD
        assert ring is not None
        self.world, self.rank = dist.get_world_size(ring), dist.get_rank(ring)
        self.next = dist.get_global_rank(ring, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(ring, (self.rank - 1) % self.world)
        self.device = comm_device(ring)

    def start(self, tensors: list[torch.Tensor], tags: list[int]) -> _Transfer:
        """Send ``tensors`` to the next rank and receive as many of the same shapes from the
        previous one (non-blocking; :meth:`_Transfer.wait` returns the received tensors)."""
        send = [t.to(self.device).contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        ops = [
            dist.P2POp(dist.isend, t, self.next, self.group, tag)
            for t, tag in zip(send, tags, strict=True)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.prev, self.group, tag)
            for t, tag in zip(recv, tags, strict=True)
        ]
        works = dist.batch_isend_irecv(ops)
        return _Transfer(list(works or []), recv, send, tensors[0].device)


@dataclass(frozen=True)
class _Block:
    """A piece of work on one held K/V block: local query rows × local key columns."""

    q: slice
    k: slice
    causal: bool
    """the position mask is needed (some pair inside is masked)"""


def _blocks(
    q_segs: list[tuple[int, int]], k_segs: list[tuple[int, int]], causal: bool
) -> list[_Block]:
    """The query×key rectangles to compute for one held block, fully masked ones skipped.

    Segments are ``(start, length)`` ranges of global positions in local order (increasing), so
    the keys a query range sees form a prefix of the held block."""
    q_len, k_len = sum(n for _, n in q_segs), sum(n for _, n in k_segs)
    if not causal:
        return [_Block(slice(0, q_len), slice(0, k_len), False)]
    blocks: list[_Block] = []
    q_off = 0
    for q_start, q_n in q_segs:
        visible, partial, k_off = 0, False, 0
        for k_start, k_n in k_segs:
            if k_start <= q_start + q_n - 1:  # some key at or before the last query
                visible = k_off + k_n
                partial |= k_start + k_n - 1 > q_start  # some key after the first query
            k_off += k_n
        if visible:
            here = _Block(slice(q_off, q_off + q_n), slice(0, visible), partial)
            last = blocks[-1] if blocks else None
            if last is not None and last.k == here.k and last.q.stop == here.q.start:
                blocks[-1] = _Block(
                    slice(last.q.start, here.q.stop), here.k, last.causal or partial
                )
            else:
                blocks.append(here)
        q_off += q_n
    return blocks


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row with no visible key) replaced by 0, so ``exp(s - lse)`` is 0."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _scores(
    q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None, scale: float
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, _NEG_INF)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block output (normalised by the block's own softmax) and the block's log-sum-exp."""
    s = _scores(q, k, keep, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), v), lse


def _merge(
    out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """Fold a block's ``(o, lse_b)`` into the running ``(out, lse)`` of query rows ``rows``."""
    old_lse = lse[..., rows]
    new_lse = torch.logaddexp(old_lse, lse_b)
    base = _finite(new_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old_lse - base).unsqueeze(-1) + o * torch.exp(
        lse_b - base
    ).unsqueeze(-1)
    lse[..., rows] = new_lse


@dataclass
class _Problem:
    """Shapes, positions and options shared by the forward and the backward."""

    ring: _Ring
    causal: bool
    scale: float
    layout: Layout
    k_shape: torch.Size
    v_shape: torch.Size
    groups: int  # query heads per K/V head

    @property
    def seq_len(self) -> int:
        return self.k_shape[2] * self.ring.world

    def segments(self, rank: int) -> list[tuple[int, int]]:
        return sequence_segments(self.seq_len, rank, self.ring.world, self.layout)

    def positions(self, rank: int, device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.segments(rank)])

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, S, D)`` → ``(B, H_kv, g, S, D)`` fp32: query heads grouped by K/V head."""
        b, h, s, d = x.shape
        return x.float().reshape(b, h // self.groups, self.groups, s, d)

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V views (fp32, with a broadcast group dimension) of a flat K/V buffer."""
        nk = self.k_shape.numel()
        k = flat[:nk].view(self.k_shape).unsqueeze(2).float()
        v = flat[nk:].view(self.v_shape).unsqueeze(2).float()
        return k, v

    def plan(
        self, src: int, q_pos: torch.Tensor, device: torch.device, pad: torch.Tensor | None
    ) -> list[tuple[_Block, torch.Tensor | None]]:
        """The blocks to compute against source ``src``'s K/V, each with its keep-mask."""
        k_pos = self.positions(src, device) if self.causal else None
        out = []
        for block in _blocks(self.segments(self.ring.rank), self.segments(src), self.causal):
            keep = None
            if block.causal:
                assert k_pos is not None
                keep = q_pos[block.q, None] >= k_pos[None, block.k]
            if pad is not None:
                pad_keep = pad[:, block.k].bool()[:, None, None, None, :]
                keep = pad_keep if keep is None else keep & pad_keep
            out.append((block, keep))
        return out

    def start(
        self, step: int, tensors: list[torch.Tensor | None], tags: list[int]
    ) -> _Transfer | None:
        if step >= self.ring.world - 1:
            return None
        pairs = [(t, tag) for t, tag in zip(tensors, tags, strict=True) if t is not None]
        return self.ring.start([t for t, _ in pairs], [tag for _, tag in pairs])


def _forward(
    p: _Problem, q: torch.Tensor, kv: torch.Tensor, pad: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    q5 = p.grouped(q)
    out = q5.new_zeros((*q5.shape[:-1], p.v_shape[-1]))
    lse = q5.new_full(q5.shape[:-1], _NEG_INF)
    q_pos = p.positions(p.ring.rank, q.device)
    for step in range(p.ring.world):
        src = (p.ring.rank - step) % p.ring.world
        # overlap: the next block is in flight while this one is computed
        pending = p.start(step, [kv, pad], [_TAG_KV, _TAG_MASK])
        k, v = p.unpack(kv)
        for block, keep in p.plan(src, q_pos, q.device, pad):
            o, lse_b = _attend(
                q5[..., block.q, :], k[..., block.k, :], v[..., block.k, :], keep, p.scale
            )
            _merge(out, lse, block.q, o, lse_b)
        if pending is not None:
            received = pending.wait()
            kv, pad = received[0], (received[1] if pad is not None else None)
    return out, lse


def _block_backward(
    p: _Problem,
    q5: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do5: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    src: int,
    q_pos: torch.Tensor,
    pad: torch.Tensor | None,
    dq: torch.Tensor,
) -> torch.Tensor:
    """Add this held block's share to ``dq``; return its flat fp32 ``(dK, dV)`` share."""
    dk = torch.zeros(p.k_shape, dtype=torch.float32, device=q5.device)
    dv = torch.zeros(p.v_shape, dtype=torch.float32, device=q5.device)
    for block, keep in p.plan(src, q_pos, q5.device, pad):
        qb, dob = q5[..., block.q, :], do5[..., block.q, :]
        kb, vb = k[..., block.k, :], v[..., block.k, :]
        lse_b, delta_b = lse[..., block.q].unsqueeze(-1), delta[..., block.q].unsqueeze(-1)
        probs = torch.exp(_scores(qb, kb, keep, p.scale) - _finite(lse_b))
        dv[..., block.k, :] += torch.matmul(probs.transpose(-1, -2), dob).sum(2)
        ds = probs * (torch.matmul(dob, vb.transpose(-1, -2)) - delta_b)
        dq[..., block.q, :] += torch.matmul(ds, kb) * p.scale
        dk[..., block.k, :] += torch.matmul(ds.transpose(-1, -2), qb).sum(2) * p.scale
    return torch.cat([dk.reshape(-1), dv.reshape(-1)])


def _backward(
    p: _Problem,
    q: torch.Tensor,
    kv: torch.Tensor,
    pad: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dQ grouped fp32, flat fp32 (dK, dV) of this rank's own block)``."""
    q5, do5 = p.grouped(q), p.grouped(dout)
    delta = (do5 * p.grouped(out)).sum(-1)
    dq = torch.zeros_like(q5)
    q_pos = p.positions(p.ring.rank, q.device)
    own: torch.Tensor | None = None
    grads: _Transfer | None = None
    for step in range(p.ring.world):
        src = (p.ring.rank - step) % p.ring.world
        pending = p.start(step, [kv, pad], [_TAG_KV, _TAG_MASK])
        k, v = p.unpack(kv)
        dkv = _block_backward(p, q5, k, v, do5, lse, delta, src, q_pos, pad, dq)
        if step == 0:  # our own block: kept here until the other ranks' shares come home
            own = dkv
        else:
            if grads is not None:  # the accumulator of this block, from the ranks before
                dkv += grads.wait()[0]
            grads = p.ring.start([dkv], [_TAG_GRAD])  # on round; after the last step, home
        if pending is not None:
            received = pending.wait()
            kv, pad = received[0], (received[1] if pad is not None else None)
    assert own is not None
    dkv = own if grads is None else own + grads.wait()[0]
    return dq, dkv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pad: torch.Tensor | None,
        problem: _Problem,
    ) -> torch.Tensor:
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        out5, lse = _forward(problem, q, kv, pad)
        out = out5.reshape(*q.shape[:-1], v.shape[-1]).to(q.dtype)
        ctx.problem = problem
        ctx.save_for_backward(q, kv, out, lse, pad)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kv, out, lse, pad = ctx.saved_tensors
        p: _Problem = ctx.problem
        dq, dkv = _backward(p, q, kv, pad, out, lse, dout)
        nk = p.k_shape.numel()
        dk = dkv[:nk].view(p.k_shape).to(kv.dtype)
        dv = dkv[nk:].view(p.v_shape).to(kv.dtype)
        return dq.reshape(q.shape).to(q.dtype), dk, dv, None, None


def _validate(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None, layout: str
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"ring_attention takes (batch, heads, S/P, dim) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}; transpose (batch, seq, heads, dim) with "
            f".transpose(1, 2)."
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must "
            f"share batch and local sequence length (and k, v their heads)."
        )
    if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} need the same head dim and "
            f"a query head count divisible by the key/value head count (grouped-query attention)."
        )
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout={layout!r} must be one of {LAYOUTS}.")
    if pad is not None and tuple(pad.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(
            f"ring_attention: key_padding_mask has shape {tuple(pad.shape)}; it must be this "
            f"rank's shard (batch, S/P) = {(k.shape[0], k.shape[2])}, split like k."
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    layout: Layout = "zigzag",
) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group`` (ring attention), a drop-in for
    :func:`torch.nn.functional.scaled_dot_product_attention` on sequence shards. Every rank of
    the group must call it with shards of the same shapes.

    Args:
        q: ``(batch, heads, S/P, dim)``, this rank's shard of the queries (SDPA's layout).
        k: ``(batch, kv_heads, S/P, dim)``; ``heads`` must be a multiple of ``kv_heads`` (GQA).
        v: ``(batch, kv_heads, S/P, dim_v)``.
        group: the sequence-parallel group (``None``: the default group).
        causal: mask keys after each query, by global position.
        key_padding_mask: ``(batch, S/P)``, split like ``k``; True/1 = a real token.
        scale: the softmax scale (default ``1/sqrt(dim)``).
        layout: how the shards were split (:mod:`kolossos.sequence.zigzag`): ``"zigzag"``
            (default; the load-balanced split for causal attention) or ``"contiguous"``. It only
            matters when ``causal``.

    Returns:
        ``(batch, heads, S/P, dim_v)``, this rank's shard of the output, in ``q``'s dtype.

    Raises:
        ValueError: inconsistent shapes, an unknown layout, or a zig-zag shard of odd length.

    Example:
        >>> from kolossos.sequence import zigzag_split
        >>> q_r, k_r, v_r = (zigzag_split(t, 2, rank, world) for t in (q, k, v))  # doctest: +SKIP
        >>> out_r = ring_attention(q_r, k_r, v_r, group, causal=True)  # doctest: +SKIP
    """
    _validate(q, k, v, key_padding_mask, layout)
    ring = _Ring(group)
    problem = _Problem(
        ring=ring,
        causal=causal,
        scale=scale if scale is not None else q.shape[-1] ** -0.5,
        layout=layout,
        k_shape=k.shape,
        v_shape=v.shape,
        groups=q.shape[1] // k.shape[1],
    )
    if causal:
        problem.segments(ring.rank)  # raises on a zig-zag shard of odd length
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    out: torch.Tensor = _RingAttention.apply(q, k, v, pad, problem)
    return out


def ring_attention_comm_bytes(
    k: torch.Tensor,
    v: torch.Tensor,
    world: int,
    *,
    key_padding_mask: bool = False,
    backward: bool = True,
) -> int:
    """Bytes one rank sends in :func:`ring_attention` (the closed form of the module docstring).

    Args:
        k: this rank's key shard (shape and dtype are used).
        v: this rank's value shard.
        world: the group's size ``P``.
        key_padding_mask: whether a key padding mask travels with the keys.
        backward: include the backward pass.

    Example:
        >>> ring_attention_comm_bytes(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8), 2)
        1536
    """
    kv = (k.numel() + v.numel()) * k.element_size()
    mask = k.shape[0] * k.shape[2] if key_padding_mask else 0
    forward = (world - 1) * (kv + mask)
    if not backward:
        return forward
    grads = (world - 1) * (k.numel() + v.numel()) * 4  # fp32 accumulators, P-1 hops
    return 2 * forward + grads
