"""``python -m benchmarks.loopback_cost``: the three ways to move a buffer between two CPU ranks
on one host, end to end on a small buffer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 600  # a hang detector: a few seconds on an idle 2-core machine


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks.loopback_cost", *args],
                          capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT,
                          check=False)  # fmt: skip


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
