"""``TorchDDPPlugin``: data parallelism with PyTorch's ``DistributedDataParallel``."""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.booster.plugin.dp_plugin_base import DPPluginBase
from kolossos.booster.plugin.plugin_base import Boosted, Criterion
from kolossos.interface import ModelWrapper, OptimizerWrapper

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO


@dataclass(frozen=True, kw_only=True)
class TorchDDPConfig:
    """Keyword arguments passed to ``torch.nn.parallel.DistributedDataParallel``."""

    broadcast_buffers: bool = True
    """Broadcast buffers (e.g. BatchNorm statistics) from rank 0 at every forward."""
    bucket_cap_mb: float = 25
    """Gradient bucket size in MiB: smaller overlaps more, larger sends fewer messages."""
    find_unused_parameters: bool = False
    """Walk the autograd graph each step to find parameters that got no gradient."""
    check_reduction: bool = False
    """Accepted for compatibility; PyTorch ignores it (deprecated upstream)."""
    gradient_as_bucket_view: bool = False
    """Gradients alias the communication buckets (saves one gradient copy of memory)."""
    static_graph: bool = False
    """The set of used parameters and the graph never change (enables extra optimisations)."""

    def __post_init__(self) -> None:
        if isinstance(self.bucket_cap_mb, bool) or not self.bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb={self.bucket_cap_mb!r} must be a positive number of MiB (e.g. 25)."
            )
        for name in (
            "broadcast_buffers",
            "find_unused_parameters",
            "check_reduction",
            "gradient_as_bucket_view",
            "static_graph",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")


def _ddp_kwargs(config: TorchDDPConfig) -> dict[str, Any]:
    """DDP's keyword arguments for this torch: newer releases renamed ``broadcast_buffers`` to
    ``forward_sync_buffers`` (buffers are then always synced once at construction)."""
    kwargs = asdict(config)
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        kwargs["forward_sync_buffers"] = kwargs.pop("broadcast_buffers")
    return kwargs


class TorchDDPModel(ModelWrapper):
    """The model returned by :class:`TorchDDPPlugin`: ``module`` is the DDP wrapper."""

    def __init__(self, module: nn.Module, config: TorchDDPConfig, group: Any) -> None:
        from kolossos.accelerator import get_accelerator

        accelerator = get_accelerator()
        module = module.to(accelerator.get_current_device())
        device_ids = [accelerator.current_device()] if accelerator.name != "cpu" else None
        super().__init__(
            DDP(module, device_ids=device_ids, process_group=group, **_ddp_kwargs(config))
        )


class TorchDDPPlugin(DPPluginBase):
    """Data parallelism over every process with PyTorch DDP: each rank holds the whole model,
    gradients are averaged by bucketed all-reduce overlapped with backward.

    Works with every ``Booster(mixed_precision=...)`` recipe, ``booster.no_sync`` for gradient
    accumulation, and clipping by norm and by value. Suits models that fit on one device.

    Args: see :class:`TorchDDPConfig` (the same names as DDP's).

    Example:
        >>> plugin = TorchDDPPlugin()
        >>> booster = Booster(plugin=plugin)
        >>> model, optimizer, criterion, loader, _ = booster.boost(model, optimizer, criterion,
        ...                                                       dataloader)  # doctest: +SKIP
    """

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        self.config = TorchDDPConfig(
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        super().__init__()

    def supported_precisions(self) -> list[str]:
        return ["fp32", "fp16", "fp16_naive", "fp16_apex", "bf16"]

    def control_precision(self) -> bool:
        return False

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        wrapped = TorchDDPModel(model, self.config, self.dp_group)
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        return wrapped, optimizer, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        from kolossos.checkpoint_io import GeneralCheckpointIO

        return GeneralCheckpointIO()

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        if not isinstance(model, TorchDDPModel):
            raise TypeError(
                f"no_sync needs the model returned by booster.boost with {self.name}, got "
                f"{type(model).__name__}."
            )
        ddp = model.module
        assert isinstance(ddp, DDP)
        return ddp.no_sync()

    def __repr__(self) -> str:
        return f"TorchDDPPlugin({self.config}, dp_size={self.dp_size})"
