"""The Tesseract (2.5D SUMMA) matrix products as autograd functions.

Inside each depth layer, rank ``(i, j)`` holds block ``(i, j)`` of both operands; the layers
work on different row blocks of the activations and the same weight blocks. Three SUMMA
kernels, each ``q`` steps; step ``l`` broadcasts one block along rows and/or columns, multiplies
locally, and (for the transposed forms) reduces the partial product to its owner. The next
step's broadcast is issued before this step's multiply, so communication overlaps computation.

==============  =====================================  =======================================
kernel          computes (blocks)                      per step
==============  =====================================  =======================================
``summa_ab``    ``C[i,j] = sum_l A[i,l] B[l,j]``       broadcast A along the row, B along the
                                                       column
``summa_abt``   ``C[i,l] = sum_j A[i,j] B[l,j]^T``     broadcast B along the column; reduce
                                                       ``A[i,j] B[l,j]^T`` along the row to l
``summa_atb``   ``C[l,j] = sum_i A[i,l]^T B[i,j]``     broadcast A along the row; reduce
                                                       ``A[i,l]^T B[i,j]`` along the column to l
==============  =====================================  =======================================

:func:`tesseract_matmul` (``Y = X W``, Colossal-AI's ``Linear2p5D``) runs ``summa_ab`` forward,
``summa_abt`` for the input gradient and ``summa_atb`` for the weight gradient; the weight
gradient is then summed over the depth group (each layer saw a different part of the batch).
:func:`tesseract_matmul_nt` (``Y = X W^T``, the vocabulary-parallel classifier) runs
``summa_abt`` forward, ``summa_ab`` and ``summa_atb`` backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D

__all__ = ["summa_ab", "summa_abt", "summa_atb", "tesseract_matmul", "tesseract_matmul_nt"]


def _broadcast(
    mine: torch.Tensor, owner: int, my_rank: int, group: ProcessGroup
) -> tuple[torch.Tensor, Work | None]:
    """Start broadcasting ``owner``'s block over ``group``: ``(buffer, work)``."""
    buf = mine if my_rank == owner else torch.empty_like(mine)
    if dist.get_world_size(group) == 1:
        return buf, None
    return buf, dist.broadcast(buf, group_src=owner, group=group, async_op=True)


def _reduce(part: torch.Tensor, owner: int, group: ProcessGroup) -> Work | None:
    """Start summing ``part`` over ``group`` into ``owner``'s copy."""
    if dist.get_world_size(group) == 1:
        return None
    return dist.reduce(part, group_dst=owner, group=group, async_op=True)


def _wait(works: list[Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()  # SYNC POINT


def summa_ab(a: torch.Tensor, b: torch.Tensor, g: Groups2p5D) -> torch.Tensor:
    """``C[i,j] = sum_l A[i,l] B[l,j]`` for 2-D blocks ``a = A[i,j]``, ``b = B[i,j]``.
    COLLECTIVE over the row and column groups."""
    q, i, j = g.tesseract_dim, g.row_index, g.col_index
    a, b = a.contiguous(), b.contiguous()
    out = a.new_zeros(a.shape[0], b.shape[1])

    def start(step: int) -> tuple[list[torch.Tensor], list[Work | None]]:
        a_buf, a_work = _broadcast(a, step, j, g.row)
        b_buf, b_work = _broadcast(b, step, i, g.col)
        return [a_buf, b_buf], [a_work, b_work]

    pending = start(0)
    for step in range(q):
        (a_l, b_l), works = pending
        if step + 1 < q:
            pending = start(step + 1)  # overlap the next broadcasts with this product
        _wait(works)
        out.addmm_(a_l, b_l)
    return out


def summa_abt(a: torch.Tensor, b: torch.Tensor, g: Groups2p5D) -> torch.Tensor:
    """``C[i,l] = sum_j A[i,j] B[l,j]^T`` for 2-D blocks ``a = A[i,j]``, ``b = B[i,j]``; the
    result block ``C[i,j]`` lands on rank ``(i, j)``. COLLECTIVE over the row and column
    groups."""
    q, i, j = g.tesseract_dim, g.row_index, g.col_index
    a, b = a.contiguous(), b.contiguous()
    result: torch.Tensor | None = None
    reducing: list[Work | None] = []
    pending = _broadcast(b, 0, i, g.col)
    for step in range(q):
        b_l, work = pending
        if step + 1 < q:
            pending = _broadcast(b, step + 1, i, g.col)
        _wait([work])
        part = a @ b_l.t()
        _wait(reducing)  # keep at most one partial product in flight
        reducing = [_reduce(part, step, g.row)]
        if step == j:
            result = part
    _wait(reducing)
    assert result is not None
    return result


def summa_atb(a: torch.Tensor, b: torch.Tensor, g: Groups2p5D) -> torch.Tensor:
    """``C[l,j] = sum_i A[i,l]^T B[i,j]`` for 2-D blocks ``a = A[i,j]``, ``b = B[i,j]``; the
    result block ``C[i,j]`` lands on rank ``(i, j)``. COLLECTIVE over the row and column
    groups."""
    q, i, j = g.tesseract_dim, g.row_index, g.col_index
    a, b = a.contiguous(), b.contiguous()
    result: torch.Tensor | None = None
    reducing: list[Work | None] = []
    pending = _broadcast(a, 0, j, g.row)
    for step in range(q):
        a_l, work = pending
        if step + 1 < q:
            pending = _broadcast(a, step + 1, j, g.row)
        _wait([work])
        part = a_l.t() @ b
        _wait(reducing)
        reducing = [_reduce(part, step, g.col)]
        if step == i:
            result = part
    _wait(reducing)
    assert result is not None
    return result


def _sum_over_depth(grad: torch.Tensor, g: Groups2p5D) -> torch.Tensor:
    """The weight gradient of the whole batch: each depth layer saw ``1/d`` of it."""
    if g.tesseract_dep > 1:
        dist.all_reduce(grad, group=g.dep)  # SYNC POINT
    return grad


class _TesseractAB(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, g: Groups2p5D) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.groups = g
        x2 = x.reshape(-1, x.shape[-1])
        return summa_ab(x2, w, g).view(*x.shape[:-1], w.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        g: Groups2p5D = ctx.groups
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = summa_abt(grad2, w, g).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _sum_over_depth(summa_atb(x.reshape(-1, x.shape[-1]), grad2, g), g)
        return grad_x, grad_w, None


class _TesseractABT(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, g: Groups2p5D) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.groups = g
        x2 = x.reshape(-1, x.shape[-1])
        return summa_abt(x2, w, g).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        g: Groups2p5D = ctx.groups
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = summa_ab(grad2, w, g).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _sum_over_depth(summa_atb(grad2, x.reshape(-1, x.shape[-1]), g), g)
        return grad_x, grad_w, None


def tesseract_matmul(x: torch.Tensor, w: torch.Tensor, groups: Groups2p5D) -> torch.Tensor:
    """``Y = X W`` over the tesseract: ``x`` is this rank's activation block ``(..., K/q)``,
    ``w`` its weight block ``(K/q, N/q)``; returns the output block ``(..., N/q)``.

    COLLECTIVE over the row and column groups forward and backward (and the depth group for the
    weight gradient, which comes out summed over the whole batch).

    Example:
        >>> y = tesseract_matmul(x_blk, linear.weight, linear.groups)  # doctest: +SKIP
    """
    out: torch.Tensor = _TesseractAB.apply(x, w, groups)
    return out


def tesseract_matmul_nt(x: torch.Tensor, w: torch.Tensor, groups: Groups2p5D) -> torch.Tensor:
    """``Y = X W^T`` over the tesseract: ``x`` is this rank's block ``(..., K/q)``, ``w`` its
    block ``(N/q, K/q)`` (rows of ``W`` split by the row index, columns by the column index);
    returns ``(..., N/q)``. COLLECTIVE like :func:`tesseract_matmul`."""
    out: torch.Tensor = _TesseractABT.apply(x, w, groups)
    return out
