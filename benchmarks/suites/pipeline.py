"""Pipeline suite: kolossos' pipeline schedules against ``torch.distributed.pipelining``.

Both rows are reported as skipped until kolossos' pipeline (``HybridParallelPlugin`` with
``pp_size > 1``) lands: a baseline alone measures nothing about kolossos.
"""

from __future__ import annotations

import importlib.util

from benchmarks.contenders import Contender
from benchmarks.suites import Suite

_MISSING = (
    "kolossos' pipeline (HybridParallelPlugin with pp_size > 1, kolossos.pipeline) has not "
    "landed; this suite runs when it does"
)


def _reason() -> str:
    if importlib.util.find_spec("kolossos.pipeline") is None:
        return _MISSING
    return (
        "kolossos.pipeline exists but this suite has no setup() for it yet: add the two "
        "contenders' setup in benchmarks/suites/pipeline.py"
    )


class KolossosPipeline(Contender):
    name, role = "kolossos-pp-1f1b", "kolossos"
    description = "HybridParallelPlugin(pp_size=2), 1F1B"

    def unavailable(self) -> str | None:
        return _reason()


class TorchPipelining(Contender):
    name = "torch-pipelining-1f1b"
    description = "torch.distributed.pipelining Schedule1F1B, 2 stages"

    def unavailable(self) -> str | None:
        return _reason()


SUITE = Suite(
    name="pipeline",
    description="kolossos pipeline vs torch.distributed.pipelining (pending)",
    contenders=lambda: {c.name: c for c in (TorchPipelining(), KolossosPipeline())},
    references=("torch-pipelining-1f1b",),
)
