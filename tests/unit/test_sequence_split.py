"""Sequence layouts without a process group: the zig-zag split and merge round trip, the positions
each rank holds, the errors, and the causal work each rank of ring attention does (balanced under
the zig-zag split, fully masked blocks skipped)."""

from __future__ import annotations

import pytest
import torch

from kolossos.sequence import (
    sequence_positions,
    sequence_segments,
    split_sequence,
    zigzag_merge,
    zigzag_split,
)
from kolossos.sequence.ring_attention import _blocks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_zigzag_round_trip(world: int, dim: int) -> None:
    x = torch.randn(4 * world, 4 * world, 2 * world)
    shards = [zigzag_split(x, dim, r, world) for r in range(world)]
    assert all(s.shape[dim] == x.shape[dim] // world for s in shards)
    assert torch.equal(zigzag_merge(shards, dim), x)


def test_zigzag_chunks_and_positions() -> None:
    x = torch.arange(16)
    assert zigzag_split(x, 0, 0, 4).tolist() == [0, 1, 14, 15]
    assert zigzag_split(x, 0, 3, 4).tolist() == [6, 7, 8, 9]
    for r in range(4):  # the positions are the tokens the split picks
        for layout in ("contiguous", "zigzag"):
            got = split_sequence(x, 0, r, 4, layout)  # type: ignore[arg-type]
            assert torch.equal(got, sequence_positions(16, r, 4, layout))  # type: ignore[arg-type]
    assert sequence_segments(16, 1, 4, "zigzag") == [(2, 2), (12, 2)]
    assert sequence_segments(16, 1, 4) == [(4, 4)]
    # every token exactly once
    held = torch.cat([sequence_positions(24, r, 3, "zigzag") for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))


def test_zigzag_split_is_differentiable() -> None:
    x = torch.randn(8, requires_grad=True)
    zigzag_split(x, 0, 1, 2).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]


def test_errors_name_value_rule_and_fix() -> None:
    x = torch.ones(6)
    with pytest.raises(ValueError, match=r"length 6 is not divisible by 4 .*pad the sequence"):
        zigzag_split(x, 0, 0, 2)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, 2\)"):
        zigzag_split(torch.ones(8), 0, 2, 2)
    with pytest.raises(ValueError, match="world=0 must be >= 1"):
        zigzag_split(torch.ones(8), 0, 0, 0)
    with pytest.raises(ValueError, match="at least one shard"):
        zigzag_merge([], 0)
    with pytest.raises(ValueError, match="one shape"):
        zigzag_merge([torch.ones(2), torch.ones(4)], 0)
    with pytest.raises(ValueError, match="length 3 is not divisible by 2"):
        zigzag_merge([torch.ones(3), torch.ones(3)], 0)
    with pytest.raises(ValueError, match="layout='rows'"):
        sequence_segments(8, 0, 2, "rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout='rows'"):
        split_sequence(x, 0, 0, 2, "rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="length 6 is not divisible by 4"):
        split_sequence(x, 0, 0, 4)


def _work(seq: int, rank: int, world: int, layout: str) -> list[int]:
    """Query-key pairs ring attention computes on ``rank`` at each step (causal)."""
    q_segs = sequence_segments(seq, rank, world, layout)  # type: ignore[arg-type]
    pairs = []
    for step in range(world):
        k_segs = sequence_segments(seq, (rank - step) % world, world, layout)  # type: ignore[arg-type]
        blocks = _blocks(q_segs, k_segs, causal=True)
        pairs.append(sum((b.q.stop - b.q.start) * (b.k.stop - b.k.start) for b in blocks))
    return pairs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_causal_work_is_balanced_by_the_zigzag_split(world: int) -> None:
    seq, c = 8 * world, 4  # c: tokens per zig-zag chunk
    block = (2 * c) ** 2
    for rank in range(world):
        work = _work(seq, rank, world, "zigzag")
        assert work[0] == 3 * c * c  # the diagonal: only the lower half computed
        assert work[1:] == [block // 2] * (world - 1)  # every other step: exactly half a block
    contiguous = [sum(_work(seq, r, world, "contiguous")) for r in range(world)]
    assert contiguous == [(2 * c) ** 2 * (r + 1) for r in range(world)]  # rank P-1 does P times


def test_blocks_mask_only_where_needed() -> None:
    # bidirectional: one unmasked block
    (only,) = _blocks([(0, 4)], [(4, 4)], causal=False)
    assert (only.q, only.k, only.causal) == (slice(0, 4), slice(0, 4), False)
    # causal, keys wholly after the queries: nothing to compute
    assert _blocks([(0, 4)], [(4, 4)], causal=True) == []
    # causal, keys wholly before: the whole block, no mask
    (before,) = _blocks([(4, 4)], [(0, 4)], causal=True)
    assert not before.causal
    # the zig-zag diagonal: the first chunk sees its own chunk (masked), the second both
    first, second = _blocks([(0, 2), (6, 2)], [(0, 2), (6, 2)], causal=True)
    assert (first.q, first.k, first.causal) == (slice(0, 2), slice(0, 2), True)
    assert (second.q, second.k, second.causal) == (slice(2, 4), slice(0, 4), True)
