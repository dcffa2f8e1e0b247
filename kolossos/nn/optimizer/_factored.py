"""Adafactor's factored second moment for a parameter of shape ``[..., H, W]`` that may be a
ZeRO flat shard and/or a tensor-parallel shard (:class:`FactoredView`).

A stepped tensor's elements are a contiguous run of the flattened (tensor-parallel local)
parameter. The run is laid over whole rows of width ``W``: rows ``[r0, r1)`` of the ``B × H``
rows (``B`` the product of the leading dimensions), starting ``s0`` elements into row ``r0``,
zero-filled around it. Row sums of ``g² + ε₁`` are then plain row sums of that block, column
sums an ``index_add`` per leading index; both are summed over the data-parallel group (ZeRO) and,
for the dimension a tensor-parallel layer splits, over its group. Every rank thus holds the
statistics of its whole tensor-parallel shard (``O(B (H + W))`` numbers).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kolossos.nn.optimizer._distributed import DistributedLayout, ShardInfo, all_reduce_sum

__all__ = ["FactoredView"]


class FactoredView:
    """The row/column geometry of one stepped tensor (module docstring)."""

    def __init__(self, info: ShardInfo, layout: DistributedLayout) -> None:
        shape = info.shape
        self.info, self.layout = info, layout
        self.h, self.w = shape[-2], shape[-1]
        self.b = math.prod(shape[:-2])
        self.row_shape = shape[:-1]
        self.col_shape = shape[:-2] + shape[-1:]
        tp, nd = info.tp, len(shape)
        self.tp_cols = tp is not None and tp.dim == nd - 1  # W is split: row sums are partial
        self.tp_rows = tp is not None and tp.dim == nd - 2  # H is split: column sums are partial
        self.w_full = tp.full_shape[-1] if tp is not None and self.tp_cols else self.w
        self.h_full = tp.full_shape[-2] if tp is not None and self.tp_rows else self.h
        numel = self.b * self.h * self.w
        offset, self.valid = (info.offset, info.valid) if info.valid is not None else (0, numel)
        if self.valid == 0:
            self.r0 = self.r1 = self.s0 = 0
        else:
            self.r0 = offset // self.w
            self.r1 = -(-(offset + self.valid) // self.w)
            self.s0 = offset - self.r0 * self.w

    def _block(self, flat: Tensor) -> Tensor:
        """The run ``flat`` laid over whole rows: ``[r1 - r0, W]``, zeros around it."""
        if not self.info.zero:
            return flat.reshape(self.b * self.h, self.w)
        block = flat.new_zeros((self.r1 - self.r0) * self.w)
        block[self.s0 : self.s0 + self.valid] = flat
        return block.view(self.r1 - self.r0, self.w)

    def _sums(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """Row sums ``[B*H]`` and column sums ``[B, W]`` of ``u`` over the whole local shard."""
        rows = u.new_zeros(self.b * self.h)
        rows[self.r0 : self.r1] = u.sum(dim=-1)
        batch = torch.arange(self.r0, self.r1, device=u.device) // self.h
        cols = u.new_zeros(self.b, self.w).index_add_(0, batch, u)
        if self.info.zero:  # sum the runs of all data-parallel ranks
            both = all_reduce_sum(torch.cat([rows, cols.reshape(-1)]), self.layout.dp_group)
            rows, cols = both[: rows.numel()], both[rows.numel() :].view(self.b, self.w)
        tp = self.info.tp
        if tp is not None and self.tp_cols:
            rows = all_reduce_sum(rows, tp.group)
        if tp is not None and self.tp_rows:
            cols = all_reduce_sum(cols, tp.group)
        return rows, cols

    def scaled_gradient(
        self, g: Tensor, state: dict[str, Any], beta2t: float, eps1: float
    ) -> Tensor:
        """Update the row/column statistics in ``state`` with ``g`` and return ``g / √V``
        (shaped like ``g``; ZeRO padding stays zero)."""
        flat = g.reshape(-1)[: self.valid]
        rows, cols = self._sums(self._block(flat * flat + eps1))
        row_avg, col_avg = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        row_avg.mul_(beta2t).add_((rows / self.w_full).view(row_avg.shape), alpha=1.0 - beta2t)
        col_avg.mul_(beta2t).add_((cols / self.h_full).view(col_avg.shape), alpha=1.0 - beta2t)
        r = row_avg.reshape(self.b, self.h)
        r_total = r.sum(dim=-1, keepdim=True)
        tp = self.info.tp
        if tp is not None and self.tp_rows:
            r_total = all_reduce_sum(r_total, tp.group)
        r_factor = (r / (r_total / self.h_full)).rsqrt().reshape(-1)[self.r0 : self.r1]
        c_factor = col_avg.reshape(self.b, self.w).rsqrt()
        batch = torch.arange(self.r0, self.r1, device=g.device) // self.h
        approx = r_factor.unsqueeze(-1) * c_factor[batch]
        if not self.info.zero:
            return approx.reshape(g.shape).mul_(g)
        out = torch.zeros_like(g).reshape(-1)
        out[: self.valid] = approx.reshape(-1)[self.s0 : self.s0 + self.valid] * flat
        return out.view_as(g)
