"""``HybridParallelModule`` / ``HybridPipelineModule``: the model :class:`HybridParallelPlugin`
returns (without / with pipeline parallelism).

It holds the sharded model on the device in the working dtype, wrapped in DDP over the
data-parallel group when gradients are averaged by DDP (``zero_stage=0`` and ``dp_size > 1``).
Floating-point inputs are cast to the working dtype in ``forward``.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kolossos.accelerator import get_accelerator
from kolossos.amp import cast_floating
from kolossos.ddp import TorchDDPConfig, TorchDDPModel
from kolossos.interface import ModelWrapper

__all__ = ["HybridParallelModule", "HybridPipelineModule"]


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
        module = module.to(get_accelerator().get_current_device())
        if dtype != torch.float32:
            module = module.to(dtype)
        super().__init__(TorchDDPModel(module, ddp, dp_group) if ddp is not None else module)
        self.dtype = dtype

    @property
    def ddp(self) -> DDP | None:
        """The DDP wrapper, if any."""
        inner = self.module
        return inner.ddp if isinstance(inner, TorchDDPModel) else None

    def no_sync(self) -> AbstractContextManager[Any]:
        """DDP's ``no_sync`` (no data-parallel communication), or a no-op context."""
        ddp = self.ddp
        return ddp.no_sync() if ddp is not None else nullcontext()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.dtype != torch.float32:
            args, kwargs = cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
        return self.module(*args, **kwargs)


class HybridPipelineModule(ModelWrapper):
    """This rank's pipeline chunks (``pp_size > 1``) on the device in the working dtype.

    Gradients are averaged over the data-parallel group by the plugin after each pipeline step
    (no DDP: it cannot follow several micro-batch forwards before their backwards). Run it with
    ``booster.execute_pipeline``; calling it directly raises.

    Args:
        chunks: this rank's model chunks (one per virtual stage it holds).
        dtype: the working dtype.
        pipeline: the plugin's :class:`~kolossos.hybrid.pipeline_runtime.PipelineRuntime`.
    """

    def __init__(self, chunks: nn.ModuleList, dtype: torch.dtype, pipeline: Any) -> None:
        chunks = chunks.to(get_accelerator().get_current_device())
        if dtype != torch.float32:
            chunks = chunks.to(dtype)
        super().__init__(chunks)
        self.dtype = dtype
        self.pipeline = pipeline
        config = getattr(chunks[0], "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            # checkpoints write config.json from the unwrapped module: the stages' model's
            config = copy.deepcopy(config)
            config.architectures = [type(chunks[0]).__name__]
            object.__setattr__(chunks, "config", config)

    @property
    def chunks(self) -> nn.ModuleList:
        """This rank's chunks, by chunk index."""
        module = self.module
        assert isinstance(module, nn.ModuleList)
        return module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a pipeline-parallel model (pp_size > 1) holds only this rank's stages; run a "
            "training step with booster.execute_pipeline(data_iter, model, criterion, optimizer)."
        )
