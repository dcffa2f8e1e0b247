"""``python -m benchmarks.chunk_comm``: the four ways to gather and reduce-scatter a chunk on gloo
ranks, end to end on a small chunk (the schemes' results are checked against each other before
timing, so a wrong scheme fails the run)."""

from __future__ import annotations

import json
import subprocess

from kolossos.testing.processes import run_module

HANG_S = 600  # a hang detector: a few seconds on an idle 2-core machine


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_module("benchmarks.chunk_comm", *args, timeout=HANG_S)


def test_every_scheme_measured_on_three_ranks() -> None:
    proc = _run("--ranks", "3", "--mib", "1", "--loops", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    schemes = ("flat", "per-slice", "point-to-point", "kolossos")
    assert set(result["schemes"]) == {f"{s}/{k}" for s in schemes
                                      for k in ("gather", "reduce-scatter")}  # fmt: skip
    for cost in result["schemes"].values():
        assert cost["wall_ms"] > 0 and cost["cpu_ms"] > 0


def test_rejects_one_rank() -> None:
    proc = _run("--ranks", "1")
    assert proc.returncode == 2 and "--ranks 1" in proc.stderr and "at least" in proc.stderr
