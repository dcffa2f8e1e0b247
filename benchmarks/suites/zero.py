"""ZeRO suite: kolossos' ``LowLevelZeroPlugin`` stage 1 and 2 against DeepSpeed ZeRO-1/2 and torch
DDP, same model, data, Adam and bucket size. Goal (LowLevelZero issue): throughput ≥ DeepSpeed's
at ≤ its memory.

DeepSpeed is optional (``bash benchmarks/setup_deepspeed.sh``); without it its rows are skipped
and the runner delegates the suite to ``.venv-bench`` when that exists. Both sides reduce
gradients in buckets of the same size (DDP's 25 MiB), so buffer memory is comparable.
"""

from __future__ import annotations

import torch.nn as nn

from benchmarks.contenders import Contender, Context, Setup, native_contenders
from benchmarks.suites import Suite
from benchmarks.suites.deepspeed import BUCKET_ELEMENTS, DeepSpeedZero, KolossosZero
from kolossos.utils.profiling import PrecisionBytes, precision_bytes


class KolossosZeroSameRecipe(KolossosZero):
    """``LowLevelZeroPlugin`` in the job's precision (``--precision bf16``: bf16 working weights
    with fp32 masters, DeepSpeed's ``bf16`` recipe) and DeepSpeed's bucket size."""

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        self.plugin_kwargs = {
            "stage": int(self.strategy[-1]),
            "precision": "bf16" if ctx.precision == "bf16" else "fp32",
            "reduce_bucket_size_in_m": BUCKET_ELEMENTS / 2**20,
        }
        return super().setup(model, ctx)

    def precision_bytes(self, ctx: Context) -> PrecisionBytes:
        if ctx.precision == "bf16":
            return precision_bytes("mixed")
        return PrecisionBytes(param=4, grad=4, optim=8)  # the fp32 master aliases the weights


def _contenders() -> dict[str, Contender]:
    rows: list[Contender] = [native_contenders()["torch-ddp"]]
    for stage in (1, 2):
        rows += [DeepSpeedZero(stage), KolossosZeroSameRecipe(stage)]
    return {c.name: c for c in rows}


SUITE = Suite(
    name="zero",
    description="LowLevelZeroPlugin stage 1/2 vs DeepSpeed ZeRO-1/2 vs torch DDP",
    contenders=_contenders,
    references=("torch-ddp", "deepspeed-zero1", "deepspeed-zero2"),
    needs="deepspeed",
    quick_models=("gpt2-tiny",),
    preimport=("torch.nn.parallel", "deepspeed", "kolossos.booster"),
)
