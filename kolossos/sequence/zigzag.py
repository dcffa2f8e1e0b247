"""Sequence layouts for context parallelism: which tokens of a sequence each rank holds.

Two layouts split a sequence of length ``S`` over ``P`` ranks:

* **contiguous**: rank ``r`` holds tokens ``[r·S/P, (r+1)·S/P)``. Fine for bidirectional
  attention; under a causal mask rank ``P-1`` does ``P`` times the work of rank 0.
* **zig-zag**: the sequence is cut into ``2P`` equal chunks and rank ``r`` holds chunks ``r`` and
  ``2P-1-r`` (in that order). Every rank then holds one early and one late chunk, so under a
  causal mask every rank computes the same number of query-key pairs (the load balancing of
  :func:`~kolossos.sequence.ring_attention.ring_attention`).

:func:`zigzag_split` and :func:`zigzag_merge` are pure tensor functions (no process group);
:func:`sequence_segments` describes a rank's tokens as ranges of global positions, which is what
the attention kernels use to build causal masks and skip fully masked blocks.

Example:
    >>> x = torch.arange(8)
    >>> [zigzag_split(x, 0, r, 2).tolist() for r in range(2)]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    >>> zigzag_merge([zigzag_split(x, 0, r, 2) for r in range(2)], 0).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "Layout",
    "sequence_positions",
    "sequence_segments",
    "split_sequence",
    "zigzag_merge",
    "zigzag_split",
]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


def _check_rank(rank: int, world: int) -> None:
    if world < 1:
        raise ValueError(f"world={world} must be >= 1 (the number of ranks sharing the sequence).")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, {world}) for world={world}.")


def _check_length(length: int, parts: int, what: str) -> None:
    if length % parts:
        raise ValueError(
            f"sequence length {length} is not divisible by {parts} ({what}); pad the sequence "
            f"to a multiple of {parts}."
        )


def zigzag_split(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's zig-zag shard of ``x`` along ``dim``: chunks ``rank`` and ``2·world-1-rank``
    of ``2·world`` equal chunks, concatenated in that order.

    Args:
        x: the whole sequence (any shape; ``dim`` is the sequence dimension).
        dim: the sequence dimension (negative values count from the end).
        rank: this rank's index in the sequence-parallel group.
        world: the group's size.

    Returns:
        A new tensor of length ``x.shape[dim] / world`` along ``dim`` (differentiable).

    Raises:
        ValueError: ``rank``/``world`` out of range, or the length not divisible by ``2·world``.

    Example:
        >>> zigzag_split(torch.arange(8), 0, 1, 2).tolist()
        [2, 3, 4, 5]
    """
    _check_rank(rank, world)
    dim = dim % x.dim() if x.dim() else 0
    _check_length(x.shape[dim], 2 * world, f"2 × world, world={world}, for the zig-zag split")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_merge(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's zig-zag shard (the inverse of :func:`zigzag_split`).

    Args:
        shards: the shards of ranks ``0 .. world-1``, in rank order (e.g. from ``all_gather``).
        dim: the sequence dimension.

    Raises:
        ValueError: no shards, shards of different shapes, or an odd shard length.

    Example:
        >>> zigzag_merge([torch.tensor([0, 3]), torch.tensor([1, 2])], 0).tolist()
        [0, 1, 2, 3]
    """
    if not shards:
        raise ValueError("zigzag_merge needs at least one shard (one per rank, in rank order).")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"zigzag shards must all have one shape, got {sorted(shapes)}.")
    dim = dim % shards[0].dim() if shards[0].dim() else 0
    _check_length(shards[0].shape[dim], 2, "each zig-zag shard holds two equal chunks")
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


def sequence_segments(
    seq_len: int, rank: int, world: int, layout: Layout = "contiguous"
) -> list[tuple[int, int]]:
    """The global positions a rank holds, as ``(start, length)`` ranges in local order.

    Args:
        seq_len: the whole sequence's length.
        rank: the rank's index in the group.
        world: the group's size.
        layout: ``"contiguous"`` (one range) or ``"zigzag"`` (two ranges).

    Example:
        >>> sequence_segments(16, 1, 2, "zigzag")
        [(4, 4), (8, 4)]
    """
    _check_rank(rank, world)
    if layout == "contiguous":
        _check_length(seq_len, world, f"world={world}, for the contiguous split")
        size = seq_len // world
        return [(rank * size, size)]
    if layout == "zigzag":
        _check_length(seq_len, 2 * world, f"2 × world, world={world}, for the zig-zag split")
        size = seq_len // (2 * world)
        return [(rank * size, size), ((2 * world - 1 - rank) * size, size)]
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}.")


def sequence_positions(
    seq_len: int, rank: int, world: int, layout: Layout = "contiguous"
) -> torch.Tensor:
    """The global position of each local token (e.g. the ``position_ids`` of a rotary
    embedding on a sharded sequence).

    Example:
        >>> sequence_positions(8, 0, 2, "zigzag").tolist()
        [0, 1, 6, 7]
    """
    segments = sequence_segments(seq_len, rank, world, layout)
    return torch.cat([torch.arange(start, start + n) for start, n in segments])


def split_sequence(
    x: torch.Tensor, dim: int, rank: int, world: int, layout: Layout = "contiguous"
) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` in ``layout`` (a copy for ``"zigzag"``, a view
    for ``"contiguous"``).

    Example:
        >>> split_sequence(torch.arange(4), 0, 1, 2).tolist()
        [2, 3]
    """
    if layout == "zigzag":
        return zigzag_split(x, dim, rank, world)
    if layout != "contiguous":
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}.")
    _check_rank(rank, world)
    dim = dim % x.dim() if x.dim() else 0
    _check_length(x.shape[dim], world, f"world={world}, for the contiguous split")
    return x.chunk(world, dim=dim)[rank]
