"""SUMMA (Scalable Universal Matrix Multiplication Algorithm) on the ``q x q`` grid, the
products of 2D tensor parallelism (Optimus, arXiv:2104.05343), as autograd functions.

Every operand is block-distributed: rank ``(i, j)`` holds block ``(i, j)`` of each matrix (rows
of an activation are its leading dimensions flattened). The three products and where their
communication goes, for one call on one rank (``q`` steps each; the broadcast of step ``t + 1``
is issued before the multiply of step ``t``, so communication overlaps computation):

===============================  ===========================================================
product                          step ``t`` on rank ``(i, j)``
===============================  ===========================================================
:func:`summa_ab`  ``C = A B``    broadcast ``A[i,t]`` along row ``i`` and ``B[t,j]`` along
                                 column ``j``; ``C[i,j] += A[i,t] B[t,j]``
:func:`summa_abt` ``C = A Bᵀ``   broadcast ``B[t,j]`` along column ``j``; reduce
                                 ``A[i,j] B[t,j]ᵀ`` along row ``i`` onto ``(i, t)``
:func:`summa_atb` ``C = Aᵀ B``   broadcast ``A[i,t]`` along row ``i``; reduce
                                 ``A[i,t]ᵀ B[i,j]`` along column ``j`` onto ``(t, j)``
===============================  ===========================================================

Backward uses the other two: for ``C = A B``, ``dA = dC Bᵀ`` (:func:`summa_abt`) and
``dB = Aᵀ dC`` (:func:`summa_atb`); for ``C = A Bᵀ``, ``dA = dC B`` and ``dB = dCᵀ A``; for
``C = Aᵀ B``, ``dA = B dCᵀ`` and ``dB = A dC``. A gradient is computed (and communicated) only
for inputs that require one — all ranks of the grid must agree on which do.

Communication volume per rank, in elements, with ``a``, ``b``, ``c`` the sizes of this rank's
blocks of ``A``, ``B``, ``C``: ``summa_ab``: ``q (a + b)`` broadcast; ``summa_abt``: ``q b``
broadcast + ``q c`` reduced; ``summa_atb``: ``q a`` broadcast + ``q c`` reduced.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from kolossos.nn.layer.parallel_2d.grid import Groups2D

__all__ = ["summa_ab", "summa_abt", "summa_atb"]


def _broadcast(buf: torch.Tensor, src: int, group: ProcessGroup) -> Work:
    work = dist.broadcast(buf, src=src, group=group, async_op=True)  # SYNC POINT (async)
    assert work is not None
    return work


def _reduce(buf: torch.Tensor, dst: int, group: ProcessGroup) -> Work:
    work = dist.reduce(buf, dst=dst, group=group, async_op=True)  # SYNC POINT (async)
    assert work is not None
    return work


def _received(mine: torch.Tensor, owner: bool) -> torch.Tensor:
    """The buffer of a broadcast: the own block when this rank sends, else a fresh one."""
    return mine if owner else torch.empty_like(mine)


def _ab(a: torch.Tensor, b: torch.Tensor, g: Groups2D) -> torch.Tensor:
    """``C[i,j] = sum_t A[i,t] B[t,j]`` (2-D blocks)."""
    if g.q == 1:
        return a @ b

    def fetch(t: int) -> tuple[torch.Tensor, torch.Tensor, list[Work]]:
        a_t, b_t = _received(a, t == g.col_index), _received(b, t == g.row_index)
        works = [_broadcast(a_t, g.row_ranks[t], g.row), _broadcast(b_t, g.col_ranks[t], g.col)]
        return a_t, b_t, works

    out = a.new_zeros(a.shape[0], b.shape[1])
    pending = fetch(0)
    for t in range(g.q):
        a_t, b_t, works = pending
        if t + 1 < g.q:
            pending = fetch(t + 1)  # in flight while this step multiplies
        for work in works:
            work.wait()
        out.addmm_(a_t, b_t)
    return out


def _reduced_steps(
    g: Groups2D, mine: int, operand: torch.Tensor, axis: str, compute: Any, reduce_axis: str
) -> torch.Tensor:
    """The broadcast-multiply-reduce loop of :func:`_abt` / :func:`_atb`: at step ``t`` the
    ``operand`` block of member ``t`` of ``axis``'s group is broadcast, ``compute`` turns it into
    a partial product, which is summed onto member ``t`` of ``reduce_axis``'s group. Returns the
    sum this rank receives (step ``mine``)."""
    group, ranks = g.group(axis), (g.row_ranks if axis == "row" else g.col_ranks)
    own_index = g.index(axis)
    red_group = g.group(reduce_axis)
    red_ranks = g.row_ranks if reduce_axis == "row" else g.col_ranks

    def fetch(t: int) -> tuple[torch.Tensor, Work]:
        buf = _received(operand, t == own_index)
        return buf, _broadcast(buf, ranks[t], group)

    result: torch.Tensor | None = None
    in_flight: deque[Work] = deque()
    pending = fetch(0)
    for t in range(g.q):
        buf, work = pending
        if t + 1 < g.q:
            pending = fetch(t + 1)
        work.wait()
        part = compute(buf)
        in_flight.append(_reduce(part, red_ranks[t], red_group))
        if t == mine:
            result = part
        if len(in_flight) > 2:  # bound the partial products held at once
            in_flight.popleft().wait()
    while in_flight:
        in_flight.popleft().wait()
    assert result is not None
    return result


def _abt(a: torch.Tensor, b: torch.Tensor, g: Groups2D) -> torch.Tensor:
    """``C[i,l] = sum_j A[i,j] B[l,j]ᵀ`` (2-D blocks)."""
    if g.q == 1:
        return a @ b.t()
    return _reduced_steps(g, g.col_index, b, "col", lambda b_t: a @ b_t.t(), "row")


def _atb(a: torch.Tensor, b: torch.Tensor, g: Groups2D) -> torch.Tensor:
    """``C[l,j] = sum_k A[k,l]ᵀ B[k,j]`` (2-D blocks)."""
    if g.q == 1:
        return a.t() @ b
    return _reduced_steps(g, g.row_index, a, "row", lambda a_t: a_t.t() @ b, "col")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _check(name: str, a: torch.Tensor, b: torch.Tensor, ok: bool, rule: str) -> None:
    if b.dim() != 2 or not ok:
        raise ValueError(
            f"{name}: blocks of shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit "
            f"({rule}, B 2-D); pass this rank's blocks of matching operands."
        )
    if a.dtype != b.dtype:
        raise TypeError(f"{name}: dtypes {a.dtype} and {b.dtype} differ; cast one operand.")


class _SummaAB(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, groups: Groups2D) -> torch.Tensor:
        ctx.groups = groups
        ctx.save_for_backward(a, b)
        out = _ab(_rows(a), b.contiguous(), groups)
        return out.view(*a.shape[:-1], b.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        g2 = _rows(grad)
        da = _abt(g2, b.contiguous(), ctx.groups).view(a.shape) if ctx.needs_input_grad[0] else None
        db = _atb(_rows(a), g2, ctx.groups) if ctx.needs_input_grad[1] else None
        return da, db, None


class _SummaABT(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, groups: Groups2D) -> torch.Tensor:
        ctx.groups = groups
        ctx.save_for_backward(a, b)
        out = _abt(_rows(a), b.contiguous(), groups)
        return out.view(*a.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        g2 = _rows(grad)
        da = _ab(g2, b.contiguous(), ctx.groups).view(a.shape) if ctx.needs_input_grad[0] else None
        db = _atb(g2, _rows(a), ctx.groups) if ctx.needs_input_grad[1] else None
        return da, db, None


class _SummaATB(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, groups: Groups2D) -> torch.Tensor:
        ctx.groups = groups
        ctx.save_for_backward(a, b)
        return _atb(_rows(a), _rows(b), groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        g = grad.contiguous()
        da = _abt(_rows(b), g, ctx.groups).view(a.shape) if ctx.needs_input_grad[0] else None
        db = _ab(_rows(a), g, ctx.groups).view(b.shape) if ctx.needs_input_grad[1] else None
        return da, db, None


def summa_ab(a: torch.Tensor, b: torch.Tensor, groups: Groups2D) -> torch.Tensor:
    """``C = A B`` over the grid. COLLECTIVE over the row and column groups (forward and
    backward).

    Args:
        a: this rank's block ``A[i,j]``, shape ``[..., k/q]`` (leading dims are rows).
        b: this rank's block ``B[i,j]``, shape ``[k/q, n/q]``.
        groups: the grid.

    Returns:
        ``C[i,j]``, shape ``[..., n/q]``.

    Example:
        >>> y_ij = summa_ab(x_ij, w_ij, groups)  # [b/q, k/q] @ [k/q, n/q]  # doctest: +SKIP
    """
    _check("summa_ab", a, b, a.shape[-1] == b.shape[0], "A[..., k] with B[k, n]")
    out: torch.Tensor = _SummaAB.apply(a, b, groups)
    return out


def summa_abt(a: torch.Tensor, b: torch.Tensor, groups: Groups2D) -> torch.Tensor:
    """``C = A Bᵀ`` over the grid. COLLECTIVE over the row and column groups.

    Args:
        a: this rank's block ``A[i,j]``, shape ``[..., k/q]``.
        b: this rank's block ``B[i,j]``, shape ``[n/q, k/q]`` (``nn.Linear``'s layout).
        groups: the grid.

    Returns:
        ``C[i,j]``, shape ``[..., n/q]``.

    Example:
        >>> logits_ij = summa_abt(x_ij, w_ij, groups)  # doctest: +SKIP
    """
    _check("summa_abt", a, b, a.shape[-1] == b.shape[1], "A[..., k] with B[n, k]")
    out: torch.Tensor = _SummaABT.apply(a, b, groups)
    return out


def summa_atb(a: torch.Tensor, b: torch.Tensor, groups: Groups2D) -> torch.Tensor:
    """``C = Aᵀ B`` over the grid (rows of ``a`` and ``b`` are contracted). COLLECTIVE over the
    row and column groups.

    Args:
        a: this rank's block ``A[i,j]``, shape ``[..., k/q]``.
        b: this rank's block ``B[i,j]``, shape ``[..., n/q]`` with the same rows.

    Returns:
        ``C[i,j]``, shape ``[k/q, n/q]``.

    Example:
        >>> dw_ij = summa_atb(x_ij, dy_ij, groups)  # doctest: +SKIP
    """
    rows_a = a.numel() // max(a.shape[-1], 1)
    rows_b = b.numel() // max(b.shape[-1], 1)
    if rows_a != rows_b or a.dtype != b.dtype:
        raise ValueError(
            f"summa_atb: blocks of shapes {tuple(a.shape)} and {tuple(b.shape)} (dtypes "
            f"{a.dtype}, {b.dtype}) must have the same rows and dtype."
        )
    out: torch.Tensor = _SummaATB.apply(a, b, groups)
    return out
