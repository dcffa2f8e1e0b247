"""``GeminiPlugin``: ZeRO stage 3 with chunk-based, heterogeneous memory management.

The recipe (the pieces live in :mod:`kolossos.zero.gemini`): validate the arguments into a
:class:`~kolossos.zero.gemini.gemini_config.GeminiConfig`; at ``boost`` wrap the model into a
:class:`~kolossos.zero.gemini.GeminiDDP` (parameters packed into chunks, sharded over the
data-parallel ranks and placed by the placement policy), then the optimizer into a
:class:`~kolossos.zero.gemini.GeminiOptimizer` (fp32 masters and states per chunk shard, loss
scaling, clipping); checkpoints go through
:class:`~kolossos.zero.gemini.checkpoint_io.GeminiCheckpointIO`.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.accelerator import get_accelerator
from kolossos.booster.plugin.dp_plugin_base import DPPluginBase
from kolossos.booster.plugin.plugin_base import Boosted, Criterion, config_from_arguments
from kolossos.interface import OptimizerWrapper
from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer
from kolossos.zero.gemini.checkpoint_io import GeminiCheckpointIO
from kolossos.zero.gemini.colo_params import find_tp_process_group
from kolossos.zero.gemini.gemini_config import GEMINI_PRECISIONS, GeminiConfig

if TYPE_CHECKING:
    from kolossos.checkpoint_io import CheckpointIO
    from kolossos.tensor import ProcessGroup

__all__ = ["GeminiPlugin"]


class GeminiPlugin(DPPluginBase):
    """ZeRO-3 over all processes: parameters, gradients and optimizer states are sharded in
    chunks, and a placement policy decides which chunks live on the device and which on the host.

    Each rank gathers a chunk's parameters just before a module uses them and frees them after;
    gradients are reduce-scattered chunk by chunk during backward; the optimizer steps this
    rank's fp32 master shard. ``booster.no_sync`` accumulates gradients locally (a kolossos
    addition: Colossal-AI 0.3 had none for Gemini). Precision is the plugin's business: do not
    pass ``Booster(mixed_precision=...)``; clip with ``max_norm`` (or
    ``optimizer.clip_grad_by_norm``), never ``torch.nn.utils.clip_grad_norm_``.

    Args: see :class:`~kolossos.zero.gemini.gemini_config.GeminiConfig` (Colossal-AI's names and
        defaults, plus ``device`` from 0.3.1 and the ``device_memory_budget`` extension; the
        seven loss-scale keywords form its ``loss_scale`` policy).
    colo_process_group: (kolossos extension) the ``kolossos.tensor.ProcessGroup`` of a model
        built under ``ColoInitContext`` with tensor-parallel ColoParameters (``tp_degree > 1``):
        Gemini's chunks are then data-parallel over its dp group, ``prepare_dataloader`` shards
        over the dp group only (the tp ranks of one dp group read the same samples) and
        ``booster.save_model`` gathers the full Hugging Face tensors (world rank 0 writes).

    Raises:
        ValueError, TypeError: an invalid argument (named), before any collective.
        RuntimeError: torch.distributed is not initialised.

    Example:
        >>> plugin = GeminiPlugin(placement_policy="static", offload_optim_frac=1.0,
        ...                       precision="bf16", max_norm=1.0)  # doctest: +SKIP
        >>> booster = Booster(plugin=plugin)  # doctest: +SKIP
        >>> model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    """

    config_factory = GeminiConfig
    plugin_arguments = ("colo_process_group",)

    def __init__(
        self,
        chunk_config_dict: dict[Any, Any] | None = None,
        chunk_init_device: torch.device | None = None,
        placement_policy: str = "static",
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        precision: str = "fp16",
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        search_range_m: float = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        memstats: Any = None,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        verbose: bool = False,
        *,
        device: torch.device | str | int | None = None,
        device_memory_budget: int | None = None,
        colo_process_group: ProcessGroup | None = None,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in self.plugin_arguments}
        self.config = config_from_arguments(GeminiConfig, arguments)
        self.config.check_device(get_accelerator().get_current_device())
        self.colo_process_group = colo_process_group
        dp_group = None
        if colo_process_group is not None and colo_process_group.tp_world_size() > 1:
            dp_group = colo_process_group.dp_process_group()
        super().__init__(dp_group)
        self._tp = dp_group is not None
        self._optimizers: weakref.WeakKeyDictionary[nn.Module, GeminiOptimizer] = (
            weakref.WeakKeyDictionary()
        )

    def supported_precisions(self) -> list[str]:
        return sorted(GEMINI_PRECISIONS)

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
        if isinstance(model, GeminiDDP):
            raise RuntimeError("the model is already a GeminiDDP; boost the plain module once.")
        found = find_tp_process_group(model)
        if found is not None and (not self._tp or found != self.colo_process_group):
            raise ValueError(
                f"the model has tensor-parallel ColoParameters on {found} but the plugin was "
                f"given colo_process_group={self.colo_process_group}; pass "
                "GeminiPlugin(colo_process_group=<that ProcessGroup>) so that data and chunks "
                "are sharded over its dp group."
            )
        wrapped = GeminiDDP(model, process_group=self.dp_group, **self.config.ddp_kwargs())
        gemini: GeminiOptimizer | None = None
        if optimizer is not None:
            inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
            gemini = GeminiOptimizer(inner, wrapped, **self.config.optimizer_kwargs())
            self._optimizers[wrapped] = gemini
        return wrapped, gemini, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        # tensor parallel: every rank takes part in the gathers and world rank 0 writes
        return GeminiCheckpointIO(None if self._tp else self.dp_group)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        if not isinstance(model, GeminiDDP):
            raise TypeError(
                f"no_sync needs the model returned by booster.boost with {self.name}; got "
                f"{type(model).__name__}."
            )
        return model.no_sync()

    def __repr__(self) -> str:
        return f"GeminiPlugin({self.config}, dp_size={self.dp_size})"
