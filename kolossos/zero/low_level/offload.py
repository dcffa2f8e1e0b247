"""Master partitions: where they live, and how they follow and feed the working weights.

For each parameter group, this rank's master partition is an ``nn.Parameter`` of ``S``
elements that the wrapped optimizer steps, fp32 by default (``master_weights=False``: in the
working dtype, see the last case):

* **fp32 working weights, no offload:** the master *is* the owned slice of the flat working
  buffer (a view, no copy): the optimizer updates the model's weights in place and only the other
  ranks' slices need gathering. Stage 1 then costs 4Ψ + 4Ψ + 8Ψ/N bytes with Adam, not
  4Ψ + 4Ψ + 12Ψ/N as with a separate copy.
* **fp16/bf16 working weights:** an fp32 copy of the owned slice on the device.
* **CPU offload:** an fp32 copy on the CPU (pinned when an accelerator is used), so the optimizer
  and its states run and stay on the CPU; after each step the updated partition is copied to the
  device in the working dtype.
* **No master weights** (``master_dtype=None``): the master is the owned slice of the working
  buffer in the working dtype, whatever that is (a CPU copy in the working dtype with offload):
  the optimizer steps the model's weights and keeps its states in their dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from kolossos.accelerator import get_accelerator
from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["MasterWeights"]


def _pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if get_accelerator().name != "cpu" else tensor


class MasterWeights:
    """This rank's master partitions, one per group (see the module doc).

    Args:
        flat_work: the groups' flat working buffers.
        layouts: their layouts.
        rank: this rank in the data-parallel group.
        offload: keep the masters on the CPU.
        master_dtype: the masters' dtype (``None``: the working dtype, no separate masters).
    """

    def __init__(
        self,
        flat_work: Sequence[torch.Tensor],
        layouts: Sequence[FlatLayout],
        rank: int,
        offload: bool,
        master_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        self.offload = offload
        self._working: list[torch.Tensor] = []
        self.params: list[nn.Parameter] = []
        self.aliased: list[bool] = []
        for flat, layout in zip(flat_work, layouts, strict=True):
            start, stop = layout.partition_range(rank)
            owned = flat[start:stop]
            dtype = master_dtype or owned.dtype
            alias = owned.dtype == dtype and not offload
            if alias:
                master = nn.Parameter(owned)
            else:
                device = torch.device("cpu") if offload else owned.device
                copy = owned.detach().to(device=device, dtype=dtype, copy=True)
                master = nn.Parameter(_pin(copy) if offload else copy)
            self._working.append(owned)
            self.params.append(master)
            self.aliased.append(alias)

    @property
    def device(self) -> torch.device:
        """Where the masters (and the optimizer states) live."""
        return self.params[0].device if self.params else torch.device("cpu")

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the updated masters into this rank's slices of the working buffers."""
        for master, owned, alias in zip(self.params, self._working, self.aliased, strict=True):
            if not alias:
                owned.copy_(master, non_blocking=owned.device.type != "cpu")

    @torch.no_grad()
    def follow_working(self) -> None:
        """Make the masters follow working weights changed from outside (e.g. a model loaded
        with ``load_state_dict``): an element changes only where the master, rounded to the
        working dtype, differs from the working value, so fp32 masters that already match
        (e.g. just loaded from a checkpoint) keep their full precision."""
        for master, owned, alias in zip(self.params, self._working, self.aliased, strict=True):
            if alias:
                continue
            current = owned.to(master.device)
            changed = master.to(owned.dtype) != current
            master.data[changed] = current[changed].to(master.dtype)
