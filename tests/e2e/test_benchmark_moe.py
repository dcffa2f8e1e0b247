"""``python -m benchmarks moe --quick`` end to end: every row is there and the all-to-all bytes
per step equal the closed form (never timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 600  # detects a hang only: ~10 s on a loaded 2-core machine


def test_quick_run_rows_and_closed_form() -> None:
    pytest.importorskip("transformers")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "moe", "--quick"],
        capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    rows = {(r["model"], r["ranks"]): r for r in record["rows"]}
    assert set(rows) == {(m, p) for m in ("moe", "dense") for p in (1, 2, 4)}
    for p in (1, 2, 4):
        moe, dense = rows["moe", p], rows["dense", p]
        assert moe["tokens_per_s"] > 0 and dense["tokens_per_s"] > 0
        assert moe["a2a_logical"] == moe["closed_logical"]
        assert (moe["a2a_logical"] > 0) == (p > 1)
        # the dense baseline's MLP (width k*I) has the parameters one token touches
        assert abs(moe["active_params"] - dense["active_params"]) / dense["active_params"] < 0.02
