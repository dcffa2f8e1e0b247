"""ZeRO-1's full flat gradient buffers, allocated when a backward first needs them (a pass that
accumulates locally: ``no_sync``, a pipeline step, :mod:`~kolossos.zero.low_level.reducer`) and
freed by ``zero_grad``.

Between ``zero_grad`` and the next backward nothing in them is needed (the next pass overwrites
every range it reaches and zeroes the others), so they are not kept alive through the forward
pass, where activations peak, while between ``no_sync`` passes (no ``zero_grad``) the
accumulated gradients stay where they are. A fresh buffer is uninitialised except for the
partitions' padding, which no parameter covers and the owner's optimizer steps, so it is zeroed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kolossos.zero.low_level.flat_buffers import param_views
from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["FlatGradBuffers"]


class FlatGradBuffers:
    """One lazily allocated flat gradient buffer per parameter group.

    Args:
        layouts: the groups' flat layouts.
        dtype: element type (the working dtype).
        device: where the buffers live.
    """

    def __init__(
        self, layouts: Sequence[FlatLayout], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layouts = list(layouts)
        self.dtype = dtype
        self.device = device
        self._flat: list[torch.Tensor | None] = [None] * len(self.layouts)
        self._views: list[list[torch.Tensor] | None] = [None] * len(self.layouts)

    def __len__(self) -> int:
        return len(self.layouts)

    def __getitem__(self, group: int) -> torch.Tensor:
        """Group ``group``'s buffer, allocated (padding zeroed) if it is not alive."""
        flat = self._flat[group]
        if flat is None:
            layout = self.layouts[group]
            flat = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
            for rank in range(layout.world_size):
                start, stop = layout.partition_range(rank)
                flat[start + layout.valid_numel(rank) : stop].zero_()
            self._flat[group] = flat
            self._views[group] = param_views(flat, layout)
        return flat

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The buffers alive now."""
        return iter([flat for flat in self._flat if flat is not None])

    def alive(self, group: int) -> bool:
        """Whether group ``group``'s buffer is allocated."""
        return self._flat[group] is not None

    def views(self, group: int) -> list[torch.Tensor]:
        """Each parameter's view of group ``group``'s buffer (allocating it)."""
        self[group]
        views = self._views[group]
        assert views is not None
        return views

    def free(self) -> None:
        """Drop every buffer (the parameters' ``.grad`` views must be dropped too)."""
        self._flat = [None] * len(self.layouts)
        self._views = [None] * len(self.layouts)
