"""GPU suite: the fastest one-device kolossos configurations against PyTorch's, for MFU.

Rows (``--world-size 1`` on one GPU, ``--precision bf16``): ``torch-ddp`` and ``fsdp2`` (bf16
autocast / FSDP2 mixed precision over fp32 weights, transformers' SDPA attention),
``kolossos-gemini`` (bf16 chunks with fp32 masters) and ``kolossos-hybrid``:
``HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16", enable_all_optimization=True)``,
bf16 weights with fp32 masters and ShardFormer's fused kernels (SDPA attention, fused norms,
fused dropout + residual adds and tanh-GELU). Every row's Adam is torch's fused CUDA kernel
(:meth:`benchmarks.contenders.Context.adam`).
"""

from __future__ import annotations

from benchmarks.contenders import Contender, native_contenders
from benchmarks.suites import Suite


def _contenders() -> dict[str, Contender]:
    from benchmarks.suites.deepspeed import KolossosGemini
    from benchmarks.suites.fsdp import RawFSDP2
    from benchmarks.suites.tp import KolossosHybrid

    rows: list[Contender] = [
        native_contenders()["torch-ddp"],
        RawFSDP2(),
        KolossosGemini(counterpart="fsdp2"),
        KolossosHybrid(
            "kolossos-hybrid",
            tp=False,
            sp=False,
            counterpart="torch-ddp",
            description="Booster(plugin=HybridParallelPlugin(tp_size=1, precision=<job's>, "
            "enable_all_optimization=True))",
            options={"enable_all_optimization": True},
        ),
    ]
    return {c.name: c for c in rows}


SUITE = Suite(
    name="gpu",
    description="one GPU: HybridParallelPlugin (fused kernels) and Gemini vs torch DDP / FSDP2",
    contenders=_contenders,
    references=("torch-ddp", "fsdp2"),
    preimport=("torch.nn.parallel", "torch.distributed.fsdp", "kolossos.booster"),
    quick_models=("gpt2-tiny",),  # kolossos-hybrid needs a transformers GPT-2
)
