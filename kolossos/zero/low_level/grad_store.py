"""Where this rank keeps the reduced gradients of its partitions between backward and step.

Two layouts, chosen once from offloading:

============  =========================================================================
``SHARD``     On the device: one partition-sized buffer per group in the working dtype,
              allocated at the first reduced bucket and dropped by ``zero_grad``. A
              ZeRO-1 pass that reduces its flat gradient buffer in place (after ``no_sync``
              passes) lends the buffer's owned slice instead (:meth:`GradStore.keep_in_place`):
              no copy, no extra memory.
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

from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["GradStore", "StoreMode"]


class StoreMode(enum.Enum):
    """How reduced gradients are kept (see the module doc)."""

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
    """

    def __init__(
        self,
        layouts: Sequence[FlatLayout],
        rank: int,
        mode: StoreMode,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layouts = list(layouts)
        self.rank = rank
        self.mode = mode
        self.dtype = torch.float32 if mode is StoreMode.OFFLOAD else dtype
        self.device = torch.device("cpu") if mode is StoreMode.OFFLOAD else device
        self._buffers: list[torch.Tensor | None] = [None] * len(self.layouts)
        self._filled = [False] * len(self.layouts)

    def accumulate(self, group: int, start: int, values: torch.Tensor) -> None:
        """Add reduced values of the flat range starting at ``start`` (owned by this rank)."""
        self._filled[group] = True
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

    def keep_in_place(self, group: int, partition: torch.Tensor) -> bool:
        """Take ``partition``, the owned slice of ZeRO-1's flat gradient buffer whose ranges are
        reduced in place, as group ``group``'s stored partition, if it can be.

        Returns ``False`` when the caller must :meth:`accumulate` the reduced values instead:
        with ``OFFLOAD``, or when an earlier (partitioned) pass already stored gradients in a
        buffer of its own.
        """
        if self.mode is StoreMode.OFFLOAD:
            return False
        buffer = self._buffers[group]
        if buffer is None:
            self._buffers[group] = buffer = partition
        if buffer.data_ptr() != partition.data_ptr():
            return False
        self._filled[group] = True
        return True

    def partition(self, group: int) -> torch.Tensor | None:
        """The reduced gradient partition of ``group`` (``S`` elements, padding included), or
        ``None`` if nothing was reduced into it since the last :meth:`clear`."""
        if not self._filled[group]:
            return None
        return self._buffers[group]

    def clear(self) -> None:
        """Forget every stored gradient (the buffers are dropped, not zeroed)."""
        self._buffers = [None] * len(self.layouts)
        self._filled = [False] * len(self.layouts)
