"""Contenders: the training configurations a suite compares (kolossos plugins and baselines).

A contender turns a fresh model into a :class:`Setup`: what to call for forward, backward, the
optimizer step and zeroing gradients, plus the objects the memory meter should register. Every
contender trains the same model with the same optimizer (Adam), data, precision and steps; the
only difference is how the work is parallelised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from benchmarks.models import ModelSpec, shard_units
from kolossos.utils.profiling import PrecisionBytes, precision_bytes

__all__ = ["Contender", "Context", "Setup", "native_contenders", "train_step"]


@dataclass(frozen=True)
class Context:
    """What every contender of a job shares."""

    spec: ModelSpec
    device: torch.device
    precision: str
    """``fp32`` or ``bf16`` (autocast: parameters, gradients and Adam states stay fp32)"""
    lr: float = 1e-4
    batch: int = 1
    """samples per rank and step"""

    def adam(self, params: Any) -> torch.optim.Adam:
        """Every contender's optimizer: Adam at ``lr``; on CUDA torch's fused kernel (one pass
        over parameters, gradients and states), elsewhere torch's default implementation."""
        return torch.optim.Adam(params, lr=self.lr, fused=self.device.type == "cuda" or None)


@dataclass
class Setup:
    """A contender's training objects, ready for :func:`train_step`."""

    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    track: list[Any] = field(default_factory=list)
    """modules and ``torch.optim.Optimizer`` objects for :meth:`MemoryMeter.track`"""
    track_as: dict[str, list[Any]] = field(default_factory=dict)
    """objects billed to a named category whatever their kind (``"params"``, ``"grads"``,
    ``"optim"``): a foreign engine's flat partitions that no module or optimizer exposes"""
    close: Callable[[], None] = lambda: None


def _forward_backward(setup: Setup, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    # A function of its own so that the logits and the loss are freed before the optimizer step.
    loss = setup.forward_loss(inputs, targets)
    setup.backward(loss)


def train_step(
    setup: Setup,
    batch: tuple[torch.Tensor, torch.Tensor],
    after_update: Callable[[], Any] | None = None,
) -> None:
    """One step: forward, loss, backward, optimizer step, ``after_update()``, zero the grads."""
    _forward_backward(setup, *batch)
    setup.step()
    if after_update is not None:
        after_update()
    setup.zero_grad()


class Contender:
    """A configuration to measure. Subclasses set the class attributes and :meth:`setup`."""

    name: str = ""
    """row name, e.g. ``kolossos-ddp``"""
    role: str = "baseline"
    """``kolossos``, ``baseline`` or ``floor`` (:class:`ComputeFloor`)"""
    strategy: str = "ddp"
    """model-state / communication estimator strategy: ``ddp``, ``zero1``, ``zero2``, ``zero3``"""
    state_strategy: str = ""
    """the model-state estimator's strategy where it differs from ``strategy``"""
    single: bool = False
    """trains on rank 0 alone (the one-process baseline)"""
    min_world: int = 1
    """the fewest ranks it can run on (a job with fewer reports the row skipped)"""
    counterpart: str = ""
    """the baseline this contender is primarily compared to (a ratio column of its own)"""
    description: str = ""

    def unavailable(self) -> str | None:
        """Why this contender cannot run here (checked in the runner), or ``None``."""
        return None

    def precision_bytes(self, ctx: Context) -> PrecisionBytes:
        """Bytes per parameter of the model states it keeps (for the estimator)."""
        return precision_bytes("fp32")

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        """Wrap ``model`` (already on ``ctx.device``) and build its optimizer."""
        raise NotImplementedError

    # helpers for the torch-native contenders
    @staticmethod
    def _autocast(ctx: Context) -> contextlib.AbstractContextManager[Any]:
        if ctx.precision == "bf16":
            return torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward_loss(
        self, module: nn.Module, ctx: Context
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self._autocast(ctx):
                return ctx.spec.loss(module(x), y)

        return forward_loss

    def _plain(self, module: nn.Module, params_of: nn.Module, ctx: Context) -> Setup:
        optimizer = ctx.adam(params_of.parameters())
        return Setup(
            forward_loss=self._forward_loss(module, ctx),
            backward=lambda loss: loss.backward(),
            step=optimizer.step,
            zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
            track=[params_of, optimizer],
        )


class SingleProcess(Contender):
    """The one-process baseline: rank 0 trains its per-rank batch alone."""

    name, single = "single", True
    description = "plain PyTorch in one process (rank 0), the per-rank batch"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        return self._plain(model, model, ctx)


class ComputeFloor(Contender):
    """Every rank runs forward and backward of its own replica: no communication, no optimizer.

    The work all rows of a job share, under the same load (it runs interleaved with them): its
    CPU seconds per token bound what any data-parallel implementation of the job can cost, so a
    baseline's CPU per token over the floor's is the largest CPU cost ratio any row can reach
    against that baseline (``python -m benchmarks summary`` prints it as the *ceiling*). Only an
    implementation that allocates less than autograd's fresh gradients (page faults) could go
    below it.
    """

    name, role = "floor", "floor"
    description = "forward + backward on each rank, no communication, no optimizer (the floor)"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        return Setup(
            forward_loss=self._forward_loss(model, ctx),
            backward=lambda loss: loss.backward(),
            step=lambda: None,
            zero_grad=lambda: model.zero_grad(set_to_none=True),
            track=[model],
        )


class TorchDDP(Contender):
    """Raw ``DistributedDataParallel`` with its defaults."""

    name = "torch-ddp"
    description = "torch.nn.parallel.DistributedDataParallel, default buckets"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return self._plain(DDP(model, device_ids=ids), model, ctx)


class KolossosBoosted(Contender):
    """A kolossos plugin through the Booster; subclasses (or instances) name the plugin class."""

    role = "kolossos"
    plugin_class = "TorchDDPPlugin"
    plugin_kwargs: dict[str, Any] = {}  # noqa: RUF012 (read-only)

    def unavailable(self) -> str | None:
        import kolossos.booster.plugin as plugins

        if not hasattr(plugins, self.plugin_class):
            return f"kolossos.booster.plugin.{self.plugin_class} has not landed yet"
        return None

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        import kolossos.booster.plugin as plugins
        from kolossos.booster import Booster

        plugin = getattr(plugins, self.plugin_class)(**self.plugin_kwargs)
        if plugin.control_precision():
            booster = Booster(plugin=plugin)
        else:
            booster = Booster(
                plugin=plugin, mixed_precision="bf16" if ctx.precision == "bf16" else None
            )
        optimizer = ctx.adam(model.parameters())
        boosted, opt, criterion, _, _ = booster.boost(model, optimizer, ctx.spec.loss)
        assert opt is not None and criterion is not None

        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return criterion(boosted(x), y)

        return Setup(
            forward_loss=forward_loss,
            backward=lambda loss: booster.backward(loss, opt),
            step=opt.step,
            zero_grad=lambda: opt.zero_grad(set_to_none=True),
            track=[model, opt.unwrap()],
        )


class KolossosDDP(KolossosBoosted):
    """``TorchDDPPlugin`` through the Booster."""

    name, counterpart = "kolossos-ddp", "torch-ddp"
    description = "Booster(plugin=TorchDDPPlugin())"


class FSDP2(Contender):
    """FSDP2 (``fully_shard``) per block and at the root: the ZeRO-3 reference."""

    name, strategy = "fsdp2", "zero3"
    description = "torch.distributed.fsdp.fully_shard on every block, then the root"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        from torch.distributed.fsdp import fully_shard

        for unit in shard_units(model):
            fully_shard(unit)
        fully_shard(model)
        return self._plain(model, model, ctx)


def native_contenders() -> dict[str, Contender]:
    """The contenders that need nothing beyond torch and kolossos, by name."""
    return {
        c.name: c for c in (SingleProcess(), TorchDDP(), KolossosDDP(), FSDP2(), ComputeFloor())
    }
