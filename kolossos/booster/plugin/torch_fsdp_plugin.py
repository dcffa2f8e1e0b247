"""``TorchFSDPPlugin``: fully sharded data parallelism with PyTorch's FSDP2 (``fully_shard``).

The recipe (the pieces live in :mod:`kolossos.fsdp`): map Colossal-AI's FSDP1-style arguments
onto an FSDP2 config; build the device mesh; at ``boost`` shard the model unit by unit, point
the optimizer at the sharded parameters and wrap it for global clipping and fp16 loss scaling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.accelerator import get_accelerator
from kolossos.amp import DynamicGradScaler
from kolossos.booster.plugin.dp_plugin_base import DPPluginBase
from kolossos.booster.plugin.plugin_base import Boosted, Criterion, config_from_arguments
from kolossos.fsdp import TorchFSDPConfig, build_config
from kolossos.fsdp.checkpoint_io import FSDPCheckpointIO
from kolossos.fsdp.mesh import build_mesh, data_parallel_group
from kolossos.fsdp.model import TorchFSDPModel
from kolossos.fsdp.optimizer import FSDPOptimizer, rebind_params
from kolossos.fsdp.shard import no_gradient_sync, shard_model
from kolossos.interface import ModelWrapper, OptimizerWrapper

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO

__all__ = ["TorchFSDPConfig", "TorchFSDPModel", "TorchFSDPPlugin"]


class TorchFSDPPlugin(DPPluginBase):
    """Fully sharded data parallelism on FSDP2: parameters, gradients and optimizer states are
    sharded over the data-parallel ranks and gathered unit by unit for compute (ZeRO-3), or kept
    gathered between forward and backward (``SHARD_GRAD_OP``), or sharded within nodes and
    replicated across them (``HYBRID_SHARD``).

    Takes Colossal-AI's arguments (those of PyTorch's FSDP1), each mapped onto FSDP2 or rejected
    with a reason (``docs/fsdp.md``), and a few of its own:

    Args:
        process_group: data-parallel group, or ``(shard_group, replicate_group)`` for hybrid.
        sharding_strategy: ``ShardingStrategy`` or its name (default ``FULL_SHARD``).
        cpu_offload: ``CPUOffload(offload_params=True)`` (or ``True``): states in CPU memory on
            an accelerator machine; a no-op (logged) without one.
        auto_wrap_policy: which submodules become units (default: transformer blocks of a
            Hugging Face model, else top-level children); FSDP1 policies and class sets work.
        backward_prefetch: ``BACKWARD_PRE`` or ``None`` (FSDP2 prefetches that way);
            ``BACKWARD_POST`` is rejected.
        mixed_precision: FSDP1 ``MixedPrecision`` or FSDP2 ``MixedPrecisionPolicy``.
        ignored_modules: modules FSDP leaves alone (not sharded, gradients not reduced).
        param_init_fn: initialises a meta-device model after sharding.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        precision: ``'fp32'``, ``'bf16'`` (bf16 compute, fp32 gradient reduction and outputs)
            or ``'fp16'`` (the same with a dynamic loss scale).
        checkpoint_format: ``'hf'`` (gathered Hugging Face files) or ``'dcp'``
            (``torch.distributed.checkpoint``) for ``shard=True`` saves.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scale.
        **kwargs: FSDP1's ``device_id``, ``forward_prefetch``, ``limit_all_gathers``,
            ``use_orig_params``, ``ignored_states``, ``device_mesh``.

    Raises:
        TypeError / ValueError / NotImplementedError: an argument that is wrong or has no FSDP2
            equivalent (the message names it), before any collective.

    Example:
        >>> plugin = TorchFSDPPlugin(precision="bf16")  # doctest: +SKIP
        >>> booster = Booster(plugin=plugin)  # doctest: +SKIP
        >>> model, optimizer, criterion, _, _ = booster.boost(
        ...     model, optimizer, criterion)  # doctest: +SKIP
    """

    config_factory = staticmethod(build_config)

    def __init__(
        self,
        process_group: Any = None,
        sharding_strategy: Any = None,
        cpu_offload: Any = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: Any = None,
        mixed_precision: Any = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        sync_module_states: bool = False,
        *,
        precision: str = "fp32",
        checkpoint_format: str = "hf",
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        **kwargs: Any,
    ) -> None:
        self.config = config_from_arguments(build_config, locals())
        super().__init__()  # checks that torch.distributed is initialised
        accelerator = get_accelerator()
        self.device = accelerator.get_current_device()
        self.mesh = build_mesh(self.config, accelerator.name)  # collective
        self.dp_group = data_parallel_group(self.mesh)
        self.dp_rank = self.mesh.mesh.flatten().tolist().index(self.rank)
        self.dp_size = self.mesh.mesh.numel()

    def supported_precisions(self) -> list[str]:
        return ["fp32", "bf16", "fp16"]

    def control_precision(self) -> bool:
        return True

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        if isinstance(model, ModelWrapper) or hasattr(model, "set_requires_gradient_sync"):
            raise TypeError(
                f"{self.name} shards a plain nn.Module; got {type(model).__name__}, which is "
                "already wrapped or sharded."
            )
        torch_optim: Optimizer | None = None
        if optimizer is not None:
            if isinstance(optimizer, OptimizerWrapper) and type(optimizer) is not OptimizerWrapper:
                raise TypeError(f"{self.name} cannot wrap a {type(optimizer).__name__} again.")
            if isinstance(optimizer, OptimizerWrapper):
                torch_optim = optimizer.unwrap()
            else:
                torch_optim = optimizer
        before = dict(model.named_parameters(remove_duplicate=False))
        shard_model(model, self.config, self.mesh, self.device, self.dp_group)  # collective
        wrapped_opt: OptimizerWrapper | None = None
        if torch_optim is not None:
            rebind_params(torch_optim, before, model)
            scaler = (
                DynamicGradScaler.from_policy(self.config.loss_scale)
                if self.config.loss_scaled
                else None
            )
            wrapped_opt = FSDPOptimizer(torch_optim, self.device, scaler, self.dp_group)
        return TorchFSDPModel(model), wrapped_opt, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        return FSDPCheckpointIO(self.dp_group, self.config.checkpoint_format)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        if not isinstance(model, TorchFSDPModel):
            raise TypeError(
                f"no_sync needs the model returned by booster.boost with {self.name}, got "
                f"{type(model).__name__}."
            )
        return no_gradient_sync(model.module)

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"TorchFSDPPlugin(sharding={cfg.sharding}, precision={cfg.precision}, "
            f"mesh={tuple(self.mesh.mesh.shape)}, checkpoint_format={cfg.checkpoint_format})"
        )
