"""Where this rank keeps the reduced gradients of its partitions between backward and step.

Three layouts, chosen once from the ZeRO stage and offloading:

============  =========================================================================
``IN_PLACE``  ZeRO-1 on the device: the reduced values stay in the full flat gradient
              buffer (the parameters' ``.grad`` are views of it); the partition is the
              owned slice of that buffer. No extra memory.
``SHARD``     ZeRO-2 on the device: one partition-sized buffer per group in the working
              dtype, allocated at the first reduced bucket and freed by ``zero_grad``.
``OFFLOAD``   CPU offload (both stages): one fp32 partition-sized buffer per group on the
              CPU, next to the fp32 master weights the CPU optimizer steps.
============  =========================================================================

Reduced buckets *accumulate* into the store, so several synchronised backward passes before one
step add up (gradient accumulation, also for ZeRO-2 where it cannot skip communication).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from kolossos.zero.low_level.grad_buffers import FlatGradBuffers
from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["GradStore", "StoreMode"]


class StoreMode(enum.Enum):
    """How reduced gradients are kept (see the module doc)."""

    IN_PLACE = "in_place"
    SHARD = "shard"
    OFFLOAD = "offload"


class GradStore:
    """This rank's reduced gradient partitions, one per parameter group.

    Args:
        layouts: the groups' flat layouts.
        rank: this rank in the data-parallel group.
        mode: the layout (see :class:`StoreMode`).
        dtype: element type of ``SHARD`` buffers (``OFFLOAD`` buffers are fp32).
        device: where ``SHARD`` buffers live (``OFFLOAD`` buffers are on the CPU).
        flat_grads: the full flat gradient buffers (``IN_PLACE`` only).
    """

    def __init__(
        self,
        layouts: Sequence[FlatLayout],
        rank: int,
        mode: StoreMode,
        dtype: torch.dtype,
        device: torch.device,
        flat_grads: FlatGradBuffers | Sequence[torch.Tensor] | None = None,
    ) -> None:
        if (mode is StoreMode.IN_PLACE) != (flat_grads is not None):
            raise ValueError("flat_grads must be given exactly for StoreMode.IN_PLACE.")
        self.layouts = list(layouts)
        self.rank = rank
        self.mode = mode
        self.dtype = torch.float32 if mode is StoreMode.OFFLOAD else dtype
        self.device = torch.device("cpu") if mode is StoreMode.OFFLOAD else device
        self._flat_grads = flat_grads  # the owner may replace the buffers: keep its sequence
        self._buffers: list[torch.Tensor | None] = [None] * len(self.layouts)
        self._filled = [False] * len(self.layouts)

    def accumulate(self, group: int, start: int, values: torch.Tensor) -> None:
        """Add reduced values of the flat range starting at ``start`` (owned by this rank).

        In ``IN_PLACE`` mode the values already sit in the flat buffer; only the fact is
        recorded (``values`` must be that very slice).
        """
        self._filled[group] = True
        if self.mode is StoreMode.IN_PLACE:
            return
        part_start, _ = self.layouts[group].partition_range(self.rank)
        buffer = self._buffers[group]
        if buffer is None:
            numel = self.layouts[group].partition_numel
            buffer = torch.zeros(numel, dtype=self.dtype, device=self.device)
            self._buffers[group] = buffer
        lo = start - part_start
        target = buffer[lo : lo + values.numel()]
        if values.device != target.device:
            values = values.to(target.device, non_blocking=False)
        target.add_(values)

    def mark_reduced(self, group: int) -> None:
        """Record that group ``group`` received reduced gradients (``IN_PLACE`` mode)."""
        self._filled[group] = True

    def has_grads(self) -> bool:
        """Whether any gradient was reduced into the store since the last :meth:`clear`."""
        return any(self._filled)

    def partition(self, group: int) -> torch.Tensor | None:
        """The reduced gradient partition of ``group`` (``S`` elements, padding included), or
        ``None`` if nothing was reduced into it since the last :meth:`clear`."""
        if not self._filled[group]:
            return None
        if self.mode is StoreMode.IN_PLACE:
            assert self._flat_grads is not None
            start, stop = self.layouts[group].partition_range(self.rank)
            return self._flat_grads[group][start:stop]
        return self._buffers[group]

    def clear(self, zero: bool = True) -> None:
        """Forget every stored gradient (``IN_PLACE`` with ``zero``: zero the flat buffers;
        without, their owner overwrites them instead)."""
        if zero and self._flat_grads is not None:
            for flat in self._flat_grads:
                flat.zero_()
        self._buffers = [None] * len(self.layouts)
        self._filled = [False] * len(self.layouts)
