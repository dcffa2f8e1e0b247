"""Sequence-parallel communication as a ring of point-to-point exchanges, each exchange
overlapped with the matmul on the chunk that is already here (Colossal-AI's
``sequence_parallelism_mode='ring'``).

The sharding is Megatron sequence parallelism ('split_gather'): between tensor-parallel regions
each rank holds ``1/P`` of the sequence. Only the communication differs:

* :func:`ring_gather_linears` replaces "all-gather the sequence, then the column-parallel
  matmuls": at every step each rank sends the chunk it holds to the next rank of the ring and
  receives one from the previous rank, and multiplies the chunk it holds meanwhile. Backward is a
  ring reduce-scatter whose partial sums for the next chunk are computed while the previous ones
  travel.
* :func:`ring_linear_reduce_scatter` replaces "row-parallel matmul, then reduce-scatter the
  sequence": the partial product for one chunk is computed while the running sum of the previous
  chunk travels. Backward is a ring all-gather of the output gradient, each received chunk
  multiplied at once.

Each rank sends ``P - 1`` chunks per op, ``(P - 1) / P`` of the full activation: the bytes of an
all-gather or reduce-scatter under the bandwidth-optimal ring model. The plain ring collectives
(:func:`ring_all_gather_along`, :func:`ring_reduce_scatter_along`) give the same values as
:func:`~kolossos.nn.layer.parallel_1d._comm.all_gather_along` and ``reduce_scatter_along``;
only the order of the additions in a reduce-scatter over more than two ranks can differ.

Every function is a collective over ``group``: all its ranks must call it with tensors of the same
shape. gloo and NCCL both run the ``batch_isend_irecv`` exchanges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import _check_divisible

__all__ = [
    "Ring",
    "ring_all_gather_along",
    "ring_gather_linears",
    "ring_linear_reduce_scatter",
    "ring_reduce_scatter_along",
]


class Ring:
    """A process group seen as a ring: each rank sends to the next and receives from the
    previous (group ranks ``r + 1`` and ``r - 1`` modulo the size)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one;
        returns the work handles (wait for them before reading ``recv``). SYNC POINT (async)."""
        ops = [
            dist.P2POp(dist.irecv, recv, self._prev, group=self.group),
            dist.P2POp(dist.isend, send, self._next, group=self.group),
        ]
        return list(dist.batch_isend_irecv(ops))

    def gather_origin(self, step: int) -> int:
        """The rank whose chunk this rank holds at ``step`` of a ring all-gather."""
        return (self.rank - step) % self.size

    def scatter_target(self, step: int) -> int:
        """The rank whose chunk this rank's running sum belongs to at ``step`` of a ring
        reduce-scatter (the last step is this rank's own)."""
        return (self.rank - step - 1) % self.size


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()  # SYNC POINT


def _ring_gather(ring: Ring, local: torch.Tensor, use: Callable[[int, torch.Tensor], None]) -> None:
    """Pass every rank's ``local`` around the ring; ``use(origin, chunk)`` runs on each chunk
    (this rank's first) while the next exchange is in flight."""
    current = local.contiguous()
    for step in range(ring.size):
        works: list[Any] = []
        incoming = None
        if step < ring.size - 1:
            incoming = torch.empty_like(current)
            works = ring.exchange(current, incoming)
        use(ring.gather_origin(step), current)  # overlaps the exchange
        _wait(works)
        if incoming is not None:
            current = incoming


def _ring_reduce_scatter(ring: Ring, partial: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """This rank's chunk of the sum over the ring of ``partial(chunk)``; the partial for the next
    chunk is computed while the running sum of the previous one travels."""
    running = partial(ring.scatter_target(0)).contiguous()
    for step in range(1, ring.size):
        incoming = torch.empty_like(running)
        works = ring.exchange(running, incoming)
        mine = partial(ring.scatter_target(step))  # overlaps the exchange
        _wait(works)
        running = incoming + mine
    return running


def ring_all_gather_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """The concatenation along ``dim`` of ``x`` from every rank in rank order, passed around the
    ring (no autograd). Equal to ``all_gather_along``."""
    ring = Ring(group)
    if ring.size == 1:
        return x
    chunks: list[torch.Tensor | None] = [None] * ring.size

    def keep(origin: int, chunk: torch.Tensor) -> None:
        chunks[origin] = chunk

    _ring_gather(ring, x, keep)
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def ring_reduce_scatter_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of ``x`` over ``group``, summed around the ring
    (no autograd). Equal to ``reduce_scatter_along`` up to the order of the additions."""
    ring = Ring(group)
    if ring.size == 1:
        return x
    _check_divisible(x, dim, ring.size, "ring_reduce_scatter_along")
    pieces = x.chunk(ring.size, dim=dim)
    return _ring_reduce_scatter(ring, lambda chunk: pieces[chunk])


def _grad_weight(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dL/dW`` of ``y = x W^T``: ``grad_y^T x`` over all leading dimensions."""
    g2 = grad_y.reshape(-1, grad_y.shape[-1])
    return g2.t().matmul(x.reshape(-1, x.shape[-1]))


class _RingGatherLinears(torch.autograd.Function):
    """Forward: ``(full_x, *[linear(full_x, W_i, b_i)])`` with the sequence gathered around the
    ring. Backward: the input gradient reduce-scattered around the ring."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, *params: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        ring = Ring(group)
        weights, biases = params[0::2], params[1::2]
        outs: list[list[torch.Tensor | None]] = [[None] * ring.size for _ in weights]
        chunks: list[torch.Tensor | None] = [None] * ring.size

        def multiply(origin: int, chunk: torch.Tensor) -> None:
            chunks[origin] = chunk
            for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
                assert w is not None
                outs[i][origin] = F.linear(chunk, w, b)

        _ring_gather(ring, x, multiply)
        full = torch.cat([c for c in chunks if c is not None], dim=dim)
        ys = [torch.cat([o for o in out if o is not None], dim=dim) for out in outs]
        ctx.save_for_backward(full, *[w for w in weights])
        ctx.dim, ctx.ring, ctx.has_bias = dim, ring, [b is not None for b in biases]
        ctx.set_materialize_grads(False)
        return (full, *ys)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor | None, *grad_ys: torch.Tensor | None) -> Any:
        full, *weights = ctx.saved_tensors
        ring, dim = ctx.ring, ctx.dim
        length = full.shape[dim] // ring.size
        live = [(g, w) for g, w in zip(grad_ys, weights, strict=True) if g is not None]

        def partial(chunk: int) -> torch.Tensor:
            start = chunk * length
            total = None if grad_full is None else grad_full.narrow(dim, start, length)
            for g, w in live:
                piece = g.narrow(dim, start, length).matmul(w)
                total = piece if total is None else total + piece
            if total is None:
                total = full.new_zeros(full.narrow(dim, start, length).shape)
            return total

        grad_x = _ring_reduce_scatter(ring, partial) if ctx.needs_input_grad[0] else None
        grads: list[torch.Tensor | None] = []
        for i, g in enumerate(grad_ys):
            wants_w, wants_b = ctx.needs_input_grad[3 + 2 * i : 5 + 2 * i]
            grads.append(_grad_weight(g, full) if g is not None and wants_w else None)
            has_bias = ctx.has_bias[i] and g is not None and wants_b
            grads.append(g.reshape(-1, g.shape[-1]).sum(0) if has_bias else None)  # type: ignore[union-attr]
        return (grad_x, None, None, *grads)


def ring_gather_linears(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: ProcessGroup,
    dim: int = 1,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Gather the sequence shards ``x`` along ``dim`` around the ring and apply every
    column-parallel linear to each chunk as it arrives. COLLECTIVE over ``group`` (forward and
    backward).

    Args:
        x: this rank's sequence shard.
        weights: the column layers' weight shards, each ``(out_i, in)``.
        biases: their bias shards (``None`` for none), one per weight.
        group: the tensor-parallel group.
        dim: the sequence dimension.

    Returns:
        ``(full_x, [linear(full_x, w_i, b_i)])``: the gathered input (its gradient, if it is used
        elsewhere, is reduce-scattered with the others) and one output per weight.

    Example:
        >>> weights, biases = [wq, wk, wv], [bq, bk, bv]
        >>> full, (q, k, v) = ring_gather_linears(shard, weights, biases, tp)  # doctest: +SKIP
    """
    if len(weights) != len(biases):
        raise ValueError(
            f"ring_gather_linears: {len(weights)} weights but {len(biases)} biases; pass one "
            "bias (or None) per weight."
        )
    dim %= x.dim()
    if dist.get_world_size(group) == 1:
        return x, [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    params: list[torch.Tensor | None] = []
    for w, b in zip(weights, biases, strict=True):
        params += [w, b]
    full, *ys = _RingGatherLinears.apply(x, dim, group, *params)
    return full, list(ys)


class _RingLinearReduceScatter(torch.autograd.Function):
    """Forward: this rank's sequence chunk of ``sum_ranks linear(x, W)``, summed around the ring.
    Backward: the output gradient gathered around the ring, each chunk multiplied on arrival."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, dim: int, group: ProcessGroup
    ) -> torch.Tensor:
        ring = Ring(group)
        length = x.shape[dim] // ring.size
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.ring = dim, ring
        return _ring_reduce_scatter(
            ring, lambda chunk: F.linear(x.narrow(dim, chunk * length, length), weight)
        )

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        ring, dim = ctx.ring, ctx.dim
        grad_x_chunks: list[torch.Tensor | None] = [None] * ring.size
        grad_chunks: list[torch.Tensor | None] = [None] * ring.size
        want_x = ctx.needs_input_grad[0]

        def multiply(origin: int, chunk: torch.Tensor) -> None:
            grad_chunks[origin] = chunk
            if want_x:
                grad_x_chunks[origin] = chunk.matmul(weight)

        _ring_gather(ring, grad_y, multiply)
        grad_x = torch.cat([g for g in grad_x_chunks if g is not None], dim=dim) if want_x else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_full = torch.cat([g for g in grad_chunks if g is not None], dim=dim)
            grad_w = _grad_weight(grad_full, x)
        return grad_x, grad_w, None, None


def ring_linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup, dim: int = 1
) -> torch.Tensor:
    """``linear(x, weight)`` of a row-parallel layer, summed over ``group`` and scattered along
    the sequence dimension ``dim``, around the ring. COLLECTIVE over ``group`` (forward and
    backward). The bias, replicated, is the caller's to add.

    Args:
        x: this rank's slice of the input features, full sequence.
        weight: this rank's ``(out, in / P)`` weight shard.
        group: the tensor-parallel group.
        dim: the sequence dimension (its size divisible by the group size).

    Raises:
        ValueError: the sequence does not divide evenly over the group.

    Example:
        >>> out_shard = ring_linear_reduce_scatter(h, down.weight, tp_group)  # doctest: +SKIP
    """
    dim %= x.dim()
    world = dist.get_world_size(group)
    if world == 1:
        return F.linear(x, weight)
    _check_divisible(x, dim, world, "ring_linear_reduce_scatter")
    out: torch.Tensor = _RingLinearReduceScatter.apply(x, weight, dim, group)
    return out
