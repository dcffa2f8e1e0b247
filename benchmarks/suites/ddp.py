"""DDP suite: kolossos' ``TorchDDPPlugin`` against raw ``DistributedDataParallel``, one process,
and FSDP2 as a sharded reference. Goal (Booster issue): kolossos-ddp / torch-ddp ≥ 0.98."""

from __future__ import annotations

from benchmarks.contenders import Contender, native_contenders
from benchmarks.suites import Suite


def _contenders() -> dict[str, Contender]:
    native = native_contenders()
    return {name: native[name] for name in ("torch-ddp", "kolossos-ddp", "single", "fsdp2")}


SUITE = Suite(
    name="ddp",
    description="TorchDDPPlugin vs torch DDP vs one process (and FSDP2)",
    contenders=_contenders,
    references=("torch-ddp", "single"),
    preimport=("torch.nn.parallel", "torch.distributed.fsdp", "kolossos.booster"),
)
