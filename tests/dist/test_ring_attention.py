"""Ring attention on gloo equals full attention computed in one process: forward output and the
gradients of Q, K and V, bidirectional (contiguous split) and causal (zig-zag and contiguous
splits), with a key padding mask and with grouped-query attention, on 2 and 4 ranks; and the bytes
it sends match the closed form."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kolossos
from kolossos.sequence import (
    ring_attention,
    ring_attention_comm_bytes,
    split_sequence,
    zigzag_merge,
)
from kolossos.testing import spawn
from kolossos.utils.profiling import CommCounter

B, H, D, DV = 2, 4, 8, 6
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _full(
    world: int, kv_heads: int, padded: bool, seed: int
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """The whole problem, the same on every rank: q, k, v, the upstream gradient, the mask."""
    seq = 4 * world  # two tokens per zig-zag chunk
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq, D, generator=gen)
    k = torch.randn(B, kv_heads, seq, D, generator=gen)
    v = torch.randn(B, kv_heads, seq, DV, generator=gen)
    dout = torch.randn(B, H, seq, DV, generator=gen)
    mask = None
    if padded:  # right padding: sequence 0 keeps 3 tokens, sequence 1 all of them
        mask = torch.ones(B, seq, dtype=torch.bool)
        mask[0, 3:] = False
    return [q, k, v], dout, mask


def _reference(
    qkv: list[torch.Tensor], dout: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    groups = q.shape[1] // k.shape[1]
    keep = None
    if mask is not None:
        keep = mask[:, None, None, :]
    if causal:
        seq = q.shape[2]
        tril = torch.ones(seq, seq, dtype=torch.bool).tril()
        keep = tril if keep is None else keep & tril
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=keep
    )
    out.backward(dout)
    return out.detach(), [t.grad for t in (q, k, v)]  # type: ignore[misc]


def _check(causal: bool, layout: str, padded: bool, kv_heads: int, seed: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    qkv, dout, mask = _full(world, kv_heads, padded, seed)
    ref_out, ref_grads = _reference(qkv, dout, mask, causal)

    def shard(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return split_sequence(x, dim, rank, world, layout)  # type: ignore[arg-type]

    q, k, v = (shard(t).clone().requires_grad_() for t in qkv)
    pad = None if mask is None else shard(mask, 1)
    out = ring_attention(q, k, v, None, causal=causal, key_padding_mask=pad, layout=layout)  # type: ignore[arg-type]
    out.backward(shard(dout))
    what = f"causal={causal} layout={layout} padded={padded} kv_heads={kv_heads} rank={rank}"
    torch.testing.assert_close(out, shard(ref_out), **TOL, msg=lambda m: f"{what} out: {m}")
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, shard(want), **TOL, msg=lambda m: f"{what} d{name}: {m}")  # noqa: B023
    if layout == "zigzag":  # the shards put back together are the whole output
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out.detach())
        torch.testing.assert_close(zigzag_merge(gathered, 2), ref_out, **TOL)


CASES: list[tuple[bool, str, bool, int]] = [
    (False, "contiguous", False, H),
    (False, "contiguous", True, H),
    (True, "zigzag", False, H),
    (True, "zigzag", True, H),
    (True, "contiguous", True, H),  # exact, only unbalanced
    (True, "zigzag", True, 2),  # grouped-query attention
    (False, "zigzag", True, 1),  # multi-query attention
]


def _bytes(world: int) -> None:
    """Bytes sent per forward+backward: measured by CommCounter = the closed form."""
    rank = dist.get_rank()
    qkv, dout, mask = _full(world, 2, True, seed=7)
    q, k, v = (split_sequence(t, 2, rank, world, "zigzag").clone().requires_grad_() for t in qkv)
    pad = split_sequence(mask, 1, rank, world, "zigzag")  # type: ignore[arg-type]
    with CommCounter() as comm:
        out = ring_attention(q, k, v, None, causal=True, key_padding_mask=pad)
        forward = comm.bytes("send")
        out.backward(split_sequence(dout, 2, rank, world, "zigzag"))
    expected_fwd = ring_attention_comm_bytes(k, v, world, key_padding_mask=True, backward=False)
    expected = ring_attention_comm_bytes(k, v, world, key_padding_mask=True)
    assert forward == pytest.approx(expected_fwd, rel=0.10)
    assert comm.bytes("send") == pytest.approx(expected, rel=0.10)
    assert comm.bytes("recv") == comm.bytes("send")  # a ring: as much comes in as goes out
    # the hops: P-1 of K/V (+ mask) each way, P-1 of the gradient accumulator
    assert comm.calls("send") == 2 * 2 * (world - 1) + (world - 1)
    assert comm.calls(kind="all_reduce") == comm.calls(kind="all_to_all") == 0


def _run(rank: int, world_size: int, port: int) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, verbose=False)
    for seed, (causal, layout, padded, kv_heads) in enumerate(CASES):
        _check(causal, layout, padded, kv_heads, seed)
    _bytes(world_size)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_equals_full_attention(world_size: int) -> None:
    spawn(_run, world_size)


def _errors(rank: int, world_size: int, port: int) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, verbose=False)
    q = torch.randn(1, 4, 6, 8)
    odd = q[:, :, :5]
    with pytest.raises(ValueError, match="length 10 is not divisible by 4"):  # 2P chunks
        ring_attention(odd, odd, odd, None, causal=True)
    with pytest.raises(ValueError, match="layout='rows'"):
        ring_attention(q, q, q, None, layout="rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key_padding_mask has shape"):
        ring_attention(q, q, q, None, key_padding_mask=torch.ones(1, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible by the key/value head count"):
        ring_attention(q, q[:, :3], q[:, :3], None)
    with pytest.raises(ValueError, match=r"\(batch, heads, S/P, dim\)"):
        ring_attention(q[0], q[0], q[0], None)


@pytest.mark.dist
def test_ring_attention_errors_name_the_rule() -> None:
    spawn(_errors, 2)


def test_ring_of_one_is_plain_attention() -> None:
    """Without a process group the ring has one rank: exact attention, nothing sent."""
    qkv, dout, mask = _full(1, H, True, seed=3)
    ref_out, ref_grads = _reference(qkv, dout, mask, causal=True)
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    out = ring_attention(q, k, v, None, causal=True, key_padding_mask=mask)
    out.backward(dout)
    torch.testing.assert_close(out, ref_out, **TOL)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)
