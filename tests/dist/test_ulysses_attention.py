"""Ulysses (all-to-all) attention on gloo equals full attention computed in one process: forward
output and the gradients of Q, K and V, causal and bidirectional, with a key padding mask, a
whole-sequence attention mask and grouped-query attention, on 2 and 4 ranks; the all-to-alls are
inverse to each other; and the bytes sent match the closed form."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kolossos
from kolossos.sequence import (
    heads_to_seq,
    seq_to_heads,
    split_sequence,
    ulysses_attention,
    ulysses_comm_bytes,
)
from kolossos.testing import spawn
from kolossos.utils.profiling import CommCounter

B, H, D, DV = 2, 4, 8, 6
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _full(
    world: int, kv_heads: int, padded: bool, seed: int
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    seq = 3 * world
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq, D, generator=gen)
    k = torch.randn(B, kv_heads, seq, D, generator=gen)
    v = torch.randn(B, kv_heads, seq, DV, generator=gen)
    dout = torch.randn(B, H, seq, DV, generator=gen)
    mask = None
    if padded:  # right padding: sequence 1 keeps 2 tokens
        mask = torch.ones(B, seq, dtype=torch.bool)
        mask[1, 2:] = False
    return [q, k, v], dout, mask


def _reference(
    qkv: list[torch.Tensor],
    dout: torch.Tensor,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=keep
    )
    out.backward(dout)
    return out.detach(), [t.grad for t in (q, k, v)]  # type: ignore[misc]


def _check(causal: bool, padded: bool, kv_heads: int, head_mask: bool, seed: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    qkv, dout, mask = _full(world, kv_heads, padded, seed)
    seq = qkv[0].shape[2]
    keep = None if mask is None else mask[:, None, None, :]
    attn_mask = None
    if head_mask:  # a per-head additive bias over the whole sequence (ALiBi-like)
        attn_mask = -torch.arange(H, dtype=torch.float32)[:, None, None] * torch.rand(seq, seq)
        attn_mask = attn_mask[None].expand(B, H, seq, seq)
    if causal:
        tril = torch.ones(seq, seq, dtype=torch.bool).tril()
        keep = tril if keep is None else keep & tril
    ref_keep = keep
    if attn_mask is not None:
        ref_keep = attn_mask if keep is None else attn_mask.masked_fill(~keep, float("-inf"))
    ref_out, ref_grads = _reference(qkv, dout, ref_keep)

    def shard(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return split_sequence(x, dim, rank, world)

    q, k, v = (shard(t).clone().requires_grad_() for t in qkv)
    pad = None if mask is None else shard(mask, 1)
    out = ulysses_attention(q, k, v, None, causal=causal, attn_mask=attn_mask, key_padding_mask=pad)
    out.backward(shard(dout))
    what = f"causal={causal} padded={padded} kv_heads={kv_heads} head_mask={head_mask} r={rank}"
    torch.testing.assert_close(out, shard(ref_out), **TOL, msg=lambda m: f"{what} out: {m}")
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, shard(want), **TOL, msg=lambda m: f"{what} d{name}: {m}")  # noqa: B023


def _layouts() -> None:
    """seq_to_heads gives rank r the whole sequence of heads [r·H/P, (r+1)·H/P); heads_to_seq
    undoes it; both in the (batch, seq, heads, dim) layout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(B * 2 * world * H * D, dtype=torch.float32).view(B, 2 * world, H, D)
    local = split_sequence(full, 1, rank, world)
    heads = seq_to_heads(local, None)
    per = H // world
    assert torch.equal(heads, full[:, :, rank * per : (rank + 1) * per])
    assert torch.equal(heads_to_seq(heads, None), local)


def _bytes(world: int) -> None:
    rank = dist.get_rank()
    qkv, dout, mask = _full(world, 2, True, seed=11)
    q, k, v = (split_sequence(t, 2, rank, world).clone().requires_grad_() for t in qkv)
    pad = split_sequence(mask, 1, rank, world)  # type: ignore[arg-type]
    with CommCounter() as comm:
        out = ulysses_attention(q, k, v, None, causal=True, key_padding_mask=pad)
        forward = comm.sent_bytes()
        out.backward(split_sequence(dout, 2, rank, world))
    expected_fwd = ulysses_comm_bytes(q, k, v, world, key_padding_mask=True, backward=False)
    expected = ulysses_comm_bytes(q, k, v, world, key_padding_mask=True)
    assert forward == pytest.approx(expected_fwd, rel=0.10)
    assert comm.sent_bytes() == pytest.approx(expected, rel=0.10)
    assert comm.calls("all_to_all") == 8  # q, k, v, out; and their gradients
    assert comm.calls("all_gather") == 1  # the key padding mask


CASES = [
    (False, False, H, False),
    (True, False, H, False),
    (False, True, H, False),
    (True, True, H, True),
    (True, True, 2, False),  # grouped-query attention
]


def _run(rank: int, world_size: int, port: int) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, verbose=False)
    for seed, case in enumerate(CASES):
        _check(*case, seed=seed)
    _check(True, True, 1, False, seed=99)  # 1 K/V head, repeated to P heads before the exchange
    _layouts()
    _bytes(world_size)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_attention_equals_full_attention(world_size: int) -> None:
    spawn(_run, world_size)


def _errors(rank: int, world_size: int, port: int) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, verbose=False)
    q = torch.randn(1, 3, 4, 8)  # 3 heads over 2 ranks
    with pytest.raises(ValueError, match=r"the query has 3 heads, not divisible by .* size 2"):
        ulysses_attention(q, q, q, None)
    q4 = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="3 key/value heads"):
        ulysses_attention(q4, q4[:, :3], q4[:, :3], None)
    with pytest.raises(ValueError, match=r"whole sequence \(8, 8\)"):
        ulysses_attention(q4, q4, q4, None, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(1, 8\)"):
        ulysses_attention(q4, q4, q4, None, key_padding_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"\(batch, heads, S/P, dim\)"):
        ulysses_attention(q4[0], q4[0], q4[0], None)
    with pytest.raises(ValueError, match="has 3 heads"):
        seq_to_heads(torch.ones(1, 4, 3, 8), None)


@pytest.mark.dist
def test_ulysses_errors_name_the_rule() -> None:
    spawn(_errors, 2)
