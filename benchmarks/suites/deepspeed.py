"""DeepSpeed suite: DeepSpeed ZeRO-1/2/3 (``DS_ACCELERATOR=cpu`` on gloo here) beside torch DDP and
FSDP2, and kolossos' ZeRO plugins (LowLevelZeroPlugin stages 1/2, GeminiPlugin).

DeepSpeed is optional: install it with ``bash benchmarks/setup_deepspeed.sh`` (a separate
``.venv-bench`` sharing the project's packages); the runner then delegates this suite to that
interpreter. On the CPU, DeepSpeed's shared-memory all-reduce op (used only for inference
all-reduce) is switched off so that the first start does not JIT-compile it for minutes; training
communication goes through ``torch.distributed`` either way.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
import torch.nn as nn

from benchmarks.contenders import Contender, Context, KolossosBoosted, Setup, native_contenders
from benchmarks.suites import Suite
from kolossos.utils.profiling import PrecisionBytes, precision_bytes

INSTALL_HINT = (
    "deepspeed is not installed: run `bash benchmarks/setup_deepspeed.sh` (creates .venv-bench) "
    "or `pip install deepspeed==0.19.8 --no-build-isolation`"
)

BUCKET_ELEMENTS = 25 * 2**20 // 4


class DeepSpeedZero(Contender):
    """``deepspeed.initialize`` with ZeRO stage 1, 2 or 3 and the same torch Adam."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"deepspeed-zero{stage}"
        self.strategy = f"zero{stage}"
        self.description = f"DeepSpeed 0.19.8 ZeRO-{stage}, torch.optim.Adam"

    def unavailable(self) -> str | None:
        return None if importlib.util.find_spec("deepspeed") is not None else INSTALL_HINT

    def precision_bytes(self, ctx: Context) -> PrecisionBytes:
        if ctx.precision == "bf16":
            return precision_bytes("mixed")
        return PrecisionBytes(param=4, grad=4, optim=12)  # it keeps an fp32 master copy anyway

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        import deepspeed
        import deepspeed.ops

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        if ctx.device.type == "cpu":  # inference-only op; building it costs minutes
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        optimizer = ctx.adam(model.parameters())
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": ctx.batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": self.stage,
                # DDP's 25 MiB buckets; DeepSpeed's default 5e8 elements would allocate 2 GB
                # fp32 buffers per rank whatever the model's size.
                "reduce_bucket_size": BUCKET_ELEMENTS,
                "allgather_bucket_size": BUCKET_ELEMENTS,
            },
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": ctx.precision == "bf16"},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ctx.spec.loss(engine(x), y)

        def close() -> None:
            destroy = getattr(engine, "destroy", None)
            if destroy is not None:
                destroy()

        return Setup(
            forward_loss=forward_loss,
            backward=engine.backward,
            step=engine.step,  # also zeroes the gradients
            zero_grad=lambda: None,
            track=[engine.module],
            track_as=_zero_partitions(engine, optimizer),
            close=close,
        )


def _zero_partitions(engine: Any, optimizer: torch.optim.Optimizer) -> dict[str, list[Any]]:
    """DeepSpeed's model states by category. The inner torch optimizer's "parameters" are its
    fp32 master partitions (optimizer state, like ours); at stage 3 the working parameters live in
    ``param.ds_tensor`` partitions and the gradients in one flat partition buffer, which no module
    exposes, so without this they would land in "other"."""
    params = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    flat = getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
    grads = [flat] if isinstance(flat, torch.Tensor) else []
    return {"optim": [optimizer], "params": params, "grads": grads}


class KolossosZero(KolossosBoosted):
    """kolossos' ``LowLevelZeroPlugin`` (ZeRO-1/2), skipped until it lands."""

    plugin_class = "LowLevelZeroPlugin"

    def __init__(self, stage: int) -> None:
        self.name = f"kolossos-zero{stage}"
        self.counterpart = f"deepspeed-zero{stage}"
        self.strategy = f"zero{stage}"
        # ZeRO-1 keeps only gradient partitions when nothing accumulates under no_sync, as
        # here (docs/zero.md): ZeRO-2's model states
        self.state_strategy = "zero2"
        self.plugin_kwargs = {"stage": stage, "precision": "fp32"}
        self.description = f"Booster(plugin=LowLevelZeroPlugin(stage={stage}))"


class KolossosGemini(KolossosBoosted):
    """kolossos' ``GeminiPlugin`` (chunk-based ZeRO-3): static placement, everything on the
    device and sharded, Colossal-AI's chunk search. Its working precision follows the job:
    ``fp32``, or ``bf16`` weights with fp32 masters under ``--precision bf16`` (the baselines'
    bf16 is autocast over fp32 weights)."""

    name, strategy, plugin_class = "kolossos-gemini", "zero3", "GeminiPlugin"
    description = "Booster(plugin=GeminiPlugin(precision=<job's>))"

    def __init__(self, counterpart: str = "deepspeed-zero3") -> None:
        self.counterpart = counterpart

    def precision_bytes(self, ctx: Context) -> PrecisionBytes:
        return precision_bytes("mixed" if ctx.precision == "bf16" else "fp32")

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        self.plugin_kwargs = {"precision": ctx.precision}
        return super().setup(model, ctx)


def _contenders() -> dict[str, Contender]:
    native = native_contenders()
    rows: list[Contender] = [native["torch-ddp"], native["fsdp2"], native["floor"]]
    rows += [DeepSpeedZero(stage) for stage in (1, 2, 3)]
    rows += [KolossosZero(1), KolossosZero(2), KolossosGemini()]
    return {c.name: c for c in rows}


SUITE = Suite(
    name="deepspeed",
    description="DeepSpeed ZeRO-1/2/3 vs torch DDP and FSDP2, and kolossos ZeRO-1/2 and Gemini",
    contenders=_contenders,
    references=("torch-ddp", "deepspeed-zero2"),
    needs="deepspeed",
    quick_models=("gpt2-tiny",),
    preimport=("torch.nn.parallel", "torch.distributed.fsdp", "deepspeed"),
)
