"""``TorchDDPModel``: a module on this process's device, wrapped in PyTorch DDP."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kolossos.accelerator import get_accelerator
from kolossos.ddp.config import TorchDDPConfig
from kolossos.interface import ModelWrapper
from kolossos.lazy import materialize_on

__all__ = ["TorchDDPModel"]


class TorchDDPModel(ModelWrapper):
    """The model returned by :class:`~kolossos.booster.plugin.TorchDDPPlugin`: ``module`` is the
    DDP wrapper around the user's module, moved to the accelerator's current device.

    Args:
        module: the user's model.
        config: DDP's options.
        group: the data-parallel process group (``None``: every process).
    """

    def __init__(
        self, module: nn.Module, config: TorchDDPConfig, group: dist.ProcessGroup | None
    ) -> None:
        accelerator = get_accelerator()
        materialize_on(module, accelerator.get_current_device(), group)  # COLLECTIVE if lazy
        module = module.to(accelerator.get_current_device())
        device_ids = [accelerator.current_device()] if accelerator.name != "cpu" else None
        super().__init__(
            DDP(module, device_ids=device_ids, process_group=group, **config.ddp_kwargs())
        )

    @property
    def ddp(self) -> DDP:
        """The DDP wrapper."""
        ddp = self.module
        assert isinstance(ddp, DDP)
        return ddp
