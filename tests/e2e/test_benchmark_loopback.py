"""``python -m benchmarks.loopback_cost``: the three ways to move a buffer between two CPU ranks
on one host, end to end on a small buffer."""

from __future__ import annotations

import json
import subprocess

from kolossos.testing.processes import run_module

HANG_S = 600  # a hang detector: a few seconds on an idle 2-core machine


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_module("benchmarks.loopback_cost", *args, timeout=HANG_S)


def test_every_path_measured() -> None:
    proc = _run("--mib", "4", "--loops", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["paths"]) == {"socket", "socket-fresh", "shared-memory"}
    for cost in result["paths"].values():
        assert cost["wall_ms"] > 0 and cost["cpu_ms"] > 0


def test_rejects_a_non_positive_size() -> None:
    proc = _run("--mib", "0")
    assert proc.returncode == 2 and "--mib 0.0" in proc.stderr and "must be positive" in proc.stderr
