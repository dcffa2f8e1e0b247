"""Benchmark suites: which contenders run side by side, and which baselines they are compared to.

A suite module defines ``SUITE``; :data:`SUITES` names them. Contenders are created on demand
(``Suite.contenders()``), so importing a suite imports no optional dependency.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.contenders import Contender

__all__ = ["SUITES", "Suite", "get_suite"]

#: suite name -> module defining ``SUITE``
SUITES = {
    "ddp": "benchmarks.suites.ddp",
    "deepspeed": "benchmarks.suites.deepspeed",
    "fsdp": "benchmarks.suites.fsdp",
    "gpu": "benchmarks.suites.gpu",
    "pipeline": "benchmarks.suites.pipeline",
    "tp": "benchmarks.suites.tp",
    "zero": "benchmarks.suites.zero",
}


@dataclass(frozen=True)
class Suite:
    """A set of contenders measured in the same job."""

    name: str
    description: str
    contenders: Callable[[], dict[str, Contender]]
    """name -> contender, in A/B order"""
    references: tuple[str, ...]
    """baselines every row's throughput is divided by (table columns, in this order)"""
    needs: str | None = None
    """an optional module some contenders import (``deepspeed``): the runner delegates the suite
    to the benchmark environment when that has it and this interpreter does not; otherwise those
    contenders report themselves skipped and the others run"""
    preimport: tuple[str, ...] = ()
    """modules to import in the parent before forking the ranks"""
    quick_models: tuple[str, ...] | None = None
    """with ``--quick`` and no ``--model``: run only these of the quick models (None: all)"""


def get_suite(name: str) -> Suite:
    """The suite called ``name``.

    Raises:
        ValueError: an unknown suite (the message lists the known ones).
    """
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose from {sorted(SUITES)}.")
    suite: Suite = importlib.import_module(SUITES[name]).SUITE
    return suite
