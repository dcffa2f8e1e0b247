"""FSDP suite: kolossos' ``TorchFSDPPlugin`` against raw FSDP2 on the same units, precision and
optimizer. Goal (FSDP issue): kolossos-fsdp / fsdp2 >= 0.98. kolossos' other ZeRO-3 engine,
``GeminiPlugin`` (chunks instead of FSDP units), runs beside them, compared to ``fsdp2`` too.

Both contenders call ``fully_shard`` on exactly the same submodules (the model's blocks or
stages, :func:`benchmarks.models.shard_units`) and then on the root, so the ratio measures what
the plugin adds (Booster dispatch, the optimizer wrapper), not a different wrapping. Under
``--precision bf16`` both use FSDP2's mixed precision as the plugin's ``precision='bf16'`` does:
bf16 parameters and compute, fp32 gradient reduction and root outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from benchmarks.contenders import Contender, Context, KolossosBoosted, Setup, native_contenders
from benchmarks.models import shard_units
from benchmarks.suites import Suite


def _policies(ctx: Context) -> tuple[Any, Any]:
    """FSDP2 mixed-precision policies (units, root) for the job's precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if ctx.precision != "bf16":
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    unit = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    return unit, root


class RawFSDP2(Contender):
    name, strategy = "fsdp2", "zero3"
    description = "torch fully_shard on every block, then the root (bf16: MixedPrecisionPolicy)"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        from torch.distributed.fsdp import fully_shard

        unit_mp, root_mp = _policies(ctx)
        for unit in shard_units(model):
            fully_shard(unit, mp_policy=unit_mp)
        fully_shard(model, mp_policy=root_mp)
        optimizer = ctx.adam(model.parameters())

        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ctx.spec.loss(model(x), y)

        return Setup(
            forward_loss=forward_loss,
            backward=lambda loss: loss.backward(),
            step=optimizer.step,
            zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
            track=[model, optimizer],
        )


class KolossosFSDP(KolossosBoosted):
    name, strategy, counterpart = "kolossos-fsdp", "zero3", "fsdp2"
    plugin_class = "TorchFSDPPlugin"
    description = "Booster(plugin=TorchFSDPPlugin(precision=..., the same units))"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        from torch.distributed.fsdp.wrap import CustomPolicy

        units = {id(m) for m in shard_units(model)}
        self.plugin_kwargs = {
            "precision": ctx.precision,
            "auto_wrap_policy": CustomPolicy(lambda m: id(m) in units),
        }
        return super().setup(model, ctx)


def _contenders() -> dict[str, Contender]:
    from benchmarks.suites.deepspeed import KolossosGemini

    rows: list[Contender] = [
        RawFSDP2(),
        KolossosFSDP(),
        KolossosGemini(counterpart="fsdp2"),
        native_contenders()["torch-ddp"],
    ]
    return {c.name: c for c in rows}


SUITE = Suite(
    name="fsdp",
    description="TorchFSDPPlugin and GeminiPlugin vs raw FSDP2 on the same units (and torch DDP)",
    contenders=_contenders,
    references=("fsdp2", "torch-ddp"),
    preimport=("torch.nn.parallel", "torch.distributed.fsdp", "kolossos.booster"),
)
