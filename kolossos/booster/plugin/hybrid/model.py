"""``HybridParallelModule``: the model :class:`HybridParallelPlugin` returns.

It holds the sharded model on the device in the working dtype, wrapped in DDP over the
data-parallel group when gradients are averaged by DDP (``zero_stage=0`` and ``dp_size > 1``).
Floating-point inputs are cast to the working dtype in ``forward``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kolossos.booster.plugin.torch_ddp_plugin import TorchDDPConfig, TorchDDPModel
from kolossos.interface import ModelWrapper
from kolossos.zero.low_level.model import cast_floating

__all__ = ["HybridParallelModule"]


class HybridParallelModule(ModelWrapper):
    """A sharded model on the device, optionally wrapped in DDP.

    Args:
        module: the sharded model (on the CPU or the device; moved and cast here).
        dtype: the working dtype.
        ddp: the DDP options, or ``None`` for no DDP (ZeRO, or one data-parallel rank).
        dp_group: the data-parallel group DDP averages over.
    """

    def __init__(
        self,
        module: nn.Module,
        dtype: torch.dtype,
        ddp: TorchDDPConfig | None,
        dp_group: dist.ProcessGroup | None,
    ) -> None:
        from kolossos.accelerator import get_accelerator

        module = module.to(get_accelerator().get_current_device())
        if dtype != torch.float32:
            module = module.to(dtype)
        super().__init__(TorchDDPModel(module, ddp, dp_group) if ddp is not None else module)
        self.dtype = dtype

    @property
    def ddp(self) -> DDP | None:
        """The DDP wrapper, if any."""
        inner = self.module
        return inner.module if isinstance(inner, TorchDDPModel) else None  # type: ignore[return-value]

    def no_sync(self) -> AbstractContextManager[Any]:
        """DDP's ``no_sync`` (no data-parallel communication), or a no-op context."""
        ddp = self.ddp
        return ddp.no_sync() if ddp is not None else nullcontext()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.dtype != torch.float32:
            args, kwargs = cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
        return self.module(*args, **kwargs)
