"""Ulysses (DeepSpeed-Ulysses) sequence parallelism: all-to-all from sequence shards to head shards.

Outside attention every rank of the sequence-parallel group (size ``P``) holds ``S/P`` tokens of
every head. Attention needs whole sequences, so before it one all-to-all turns the layout
``(batch, S/P, heads, dim)`` into ``(batch, S, heads/P, dim)`` — every rank then holds the whole
sequence of ``heads/P`` heads and runs ordinary attention on them — and after it the inverse
all-to-all turns the output back. Heads are independent, so the result is exactly full attention.

Communication (per rank, ``N = batch · S/P · heads · dim · bytes`` the size of one local
activation): forward sends q, k, v and receives the output, four all-to-alls of logical size ``N``
(each puts ``(P-1)/P · N`` on the wire); backward does the same with the gradients: ``8 N``
logical bytes per forward+backward, ``8 (P-1)/P · N`` sent (k, v count with their own head count
under GQA). The volume per rank is constant in ``P`` when ``S`` grows with ``P``, unlike the
all-gathers of tensor parallelism. A key padding mask adds one all-gather of ``batch · S`` bytes.

Limits: the (query) head count must be divisible by ``P``. Grouped-query attention (fewer K/V
heads) works when the K/V head count is divisible by ``P``, or divides ``P`` (K/V heads are then
repeated to ``P`` before the exchange, so every rank still receives the K/V heads its query heads
use).

Example:
    >>> out = ulysses_attention(q, k, v, group, causal=True)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kolossos.cluster.collectives import comm_device

__all__ = [
    "all_to_all",
    "heads_to_seq",
    "seq_to_heads",
    "ulysses_attention",
    "ulysses_comm_bytes",
]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    world = _group_size(group)
    if world == 1:
        return x
    # piece i of the scatter dimension goes to rank i; what rank i sends us is piece i of the
    # gather dimension
    home = x.device
    send = torch.stack(x.chunk(world, dim=scatter_dim)).to(comm_device(group)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # SYNC POINT
    return torch.cat(recv.to(home).unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        scatter_dim: int,
        gather_dim: int,
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Split ``x`` into ``P`` pieces along ``scatter_dim``, send piece ``i`` to rank ``i``, and
    concatenate what every rank sent along ``gather_dim`` (autograd-aware: the backward is the
    inverse all-to-all). A collective over ``group``.

    Args:
        x: this rank's tensor; ``x.shape[scatter_dim]`` must be divisible by ``P``.
        group: the process group (``None``: the default group).
        scatter_dim: the dimension split across ranks.
        gather_dim: the dimension the received pieces are concatenated along.

    Raises:
        ValueError: ``x.shape[scatter_dim]`` not divisible by the group size.

    Example:
        >>> y = all_to_all(x, group, scatter_dim=2, gather_dim=1)  # doctest: +SKIP
    """
    world = _group_size(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % world:
        raise ValueError(
            f"all_to_all: dimension {scatter_dim} of shape {tuple(x.shape)} has size "
            f"{x.shape[scatter_dim]}, not divisible by the group size {world}; choose a group "
            f"size that divides it."
        )
    out: torch.Tensor = _AllToAll.apply(x, group, scatter_dim, gather_dim)
    return out


def _check_heads(heads: int, world: int, what: str) -> None:
    if heads % world:
        raise ValueError(
            f"Ulysses attention: {what} has {heads} heads, not divisible by the sequence-parallel "
            f"size {world}; every rank must get a whole number of heads. Use sp_size dividing "
            f"{heads}, or the 'ring_attn' mode, which has no such rule."
        )


def seq_to_heads(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, seq_dim: int = 1, head_dim: int = 2
) -> torch.Tensor:
    """Sequence-sharded to head-sharded: ``(batch, S/P, heads, dim)`` →
    ``(batch, S, heads/P, dim)`` (other layouts through ``seq_dim``/``head_dim``). A collective.

    The sequence shards must be contiguous and in rank order (rank ``r`` holds tokens
    ``[r·S/P, (r+1)·S/P)``); rank ``r`` receives heads ``[r·heads/P, (r+1)·heads/P)``.

    Raises:
        ValueError: heads not divisible by the group size.

    Example:
        >>> seq_to_heads(torch.ones(2, 8, 4, 16), group).shape  # P = 2  # doctest: +SKIP
        torch.Size([2, 16, 2, 16])
    """
    _check_heads(x.shape[head_dim], _group_size(group), "the tensor")
    return all_to_all(x, group, scatter_dim=head_dim, gather_dim=seq_dim)


def heads_to_seq(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, seq_dim: int = 1, head_dim: int = 2
) -> torch.Tensor:
    """Head-sharded back to sequence-sharded: ``(batch, S, heads/P, dim)`` →
    ``(batch, S/P, heads, dim)`` (the inverse of :func:`seq_to_heads`). A collective.

    Raises:
        ValueError: the sequence length not divisible by the group size.

    Example:
        >>> heads_to_seq(torch.ones(2, 16, 2, 16), group).shape  # P = 2  # doctest: +SKIP
        torch.Size([2, 8, 4, 16])
    """
    return all_to_all(x, group, scatter_dim=seq_dim, gather_dim=head_dim)


def _full_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    heads: tuple[int, int],
    seq_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """One SDPA mask (bool: True = attend, or additive float) for this rank's heads
    ``[heads[0], heads[1])`` over the whole sequence, or ``None``."""
    mask = attn_mask
    if mask is not None and mask.dim() == 4 and mask.shape[1] > 1:  # per head: this rank's
        mask = mask[:, heads[0] : heads[1]]
    if key_padding_mask is not None:
        keep = key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = keep if mask is None else _and(mask, keep)
    if causal:
        tril = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        mask = tril if mask is None else _and(mask, tril)
    return mask


def _and(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def _expand_kv(kv: torch.Tensor, world: int, heads: int) -> torch.Tensor:
    kv_heads = kv.shape[1]
    if kv_heads % world == 0:
        return kv
    if world % kv_heads == 0 and heads % world == 0:
        return kv.repeat_interleave(world // kv_heads, dim=1)
    raise ValueError(
        f"Ulysses attention: {kv_heads} key/value heads can be split over the sequence-parallel "
        f"size {world} only when one divides the other; use sp_size dividing {kv_heads} or a "
        f"multiple of it that divides {heads}."
    )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over a sequence sharded across ``group``, a drop-in for
    :func:`torch.nn.functional.scaled_dot_product_attention` on sequence shards.

    Args:
        q: ``(batch, heads, S/P, dim)``, this rank's contiguous sequence shard (SDPA's layout).
        k: ``(batch, kv_heads, S/P, dim)``; ``kv_heads`` may be fewer (GQA/MQA, see the module).
        v: like ``k`` (its last dimension may differ).
        group: the sequence-parallel group (``None``: the default group).
        causal: a causal mask over the whole sequence's positions.
        attn_mask: an SDPA mask over the **whole** sequence, broadcastable to
            ``(batch, heads, S, S)`` (bool: True = attend, or additive float); a per-head mask
            is sliced to this rank's heads.
        key_padding_mask: ``(batch, S/P)`` this rank's shard, True/1 = a real token; gathered
            over the group.
        dropout_p: attention dropout (its random draws differ from a single-process run).
        scale: the softmax scale (default ``1/sqrt(dim)``).

    Returns:
        ``(batch, heads, S/P, dim_v)``, this rank's shard of the attention output.

    Raises:
        ValueError: head counts not divisible by the group size, or a mask of the wrong shape.

    Example:
        >>> out = ulysses_attention(q, k, v, group, causal=True)  # doctest: +SKIP
    """
    world = _group_size(group)
    _validate(q, k, v, attn_mask, key_padding_mask, world)
    heads = q.shape[1]
    k, v = _expand_kv(k, world, heads), _expand_kv(v, world, heads)
    q_h, k_h, v_h = (seq_to_heads(t, group, seq_dim=2, head_dim=1) for t in (q, k, v))
    seq_len = q_h.shape[2]
    if key_padding_mask is not None:
        key_padding_mask = _gather_padding(key_padding_mask, group, world)
    rank = dist.get_rank(group) if world > 1 else 0
    local = heads // world
    # causal alone: SDPA's is_causal (no S x S mask built, none kept for backward)
    only_causal = causal and attn_mask is None and key_padding_mask is None
    mask = _full_mask(
        attn_mask,
        key_padding_mask,
        causal and not only_causal,
        (rank * local, (rank + 1) * local),
        seq_len,
        q.device,
    )
    out = F.scaled_dot_product_attention(
        q_h,
        k_h,
        v_h,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=only_causal,
        scale=scale,
        enable_gqa=k_h.shape[1] != q_h.shape[1],
    )
    return heads_to_seq(out, group, seq_dim=2, head_dim=1)


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    world: int,
) -> None:
    """Every check before the first collective, so a bad call fails on every rank alike."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"Ulysses attention takes (batch, heads, S/P, dim) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}; transpose (batch, seq, heads, dim) with "
            f".transpose(1, 2)."
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"Ulysses attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
            f"must share batch and local sequence length (and k, v their heads)."
        )
    _check_heads(q.shape[1], world, "the query")
    seq_len = q.shape[2] * world
    if attn_mask is not None and attn_mask.shape[-2:] != (seq_len, seq_len):
        raise ValueError(
            f"Ulysses attention: attn_mask has shape {tuple(attn_mask.shape)}; its last two "
            f"dimensions must be the whole sequence ({seq_len}, {seq_len}), not the local "
            f"shard (pass key padding as key_padding_mask, which is sharded)."
        )
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"Ulysses attention: key_padding_mask has shape {tuple(key_padding_mask.shape)}; it "
            f"must be this rank's shard (batch, S/P) = {(q.shape[0], q.shape[2])}."
        )


def _gather_padding(
    mask: torch.Tensor, group: dist.ProcessGroup | None, world: int
) -> torch.Tensor:
    if world == 1:
        return mask
    home = mask.device
    # uint8 on the wire: every backend reduces and gathers bytes, not all of them bools
    local = mask.to(device=comm_device(group), dtype=torch.uint8).contiguous()
    full = torch.empty(
        (world * local.shape[0], *local.shape[1:]), dtype=torch.uint8, device=local.device
    )
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases lack it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(full, local, group=group)  # SYNC POINT
    return torch.cat(full.chunk(world), dim=1).to(device=home, dtype=torch.bool)


def ulysses_comm_bytes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world: int,
    *,
    key_padding_mask: bool = False,
    backward: bool = True,
) -> float:
    """Bytes one rank sends in :func:`ulysses_attention` (the closed form of the module
    docstring): each all-to-all of a local tensor of ``n`` bytes sends ``(P-1)/P · n``.

    Args:
        q: this rank's query shard ``(batch, heads, S/P, dim)`` (shape and dtype are used).
        k: this rank's key shard.
        v: this rank's value shard.
        world: the group's size ``P``.
        key_padding_mask: whether a key padding mask is gathered.
        backward: include the backward pass.

    Example:
        >>> t = torch.ones(1, 2, 4, 8)
        >>> ulysses_comm_bytes(t, t, t, 2)
        1024.0
    """
    size = q.element_size()
    kv_heads = k.shape[1] if k.shape[1] % world == 0 else world  # repeated to P heads (GQA)
    per_head = k.shape[0] * k.shape[2] * size
    out = q.numel() // q.shape[-1] * v.shape[-1]
    exchanged = (q.numel() + out) * size + kv_heads * per_head * (k.shape[-1] + v.shape[-1])
    total = exchanged * (2 if backward else 1)  # the gradients take the same way back
    mask = k.shape[0] * k.shape[2] * world if key_padding_mask else 0  # all-gathered bytes
    return (world - 1) / world * (total + mask)
