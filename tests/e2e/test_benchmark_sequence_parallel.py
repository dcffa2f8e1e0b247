"""``python -m benchmarks sequence_parallel --quick`` end to end: every row is there, the memory
figures are sane and the traffic equals the kernels' closed forms (never timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 900  # detects a hang only: ~90 s on a loaded 2-core machine
SPLIT = ("tp", "tp_eager", "rsa", "ulysses", "ring_attn")
SEQUENCE = ("rsa", "ulysses", "ring_attn")


@pytest.fixture(scope="module")
def quick() -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "sequence_parallel", "--quick"],
        capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
    return proc, json.loads(line)


def _rows(record: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["mode"], r["ranks"]): r for r in record["rows"]}


def test_every_row_is_reported(quick: tuple[Any, dict[str, Any]]) -> None:
    proc, record = quick
    rows = _rows(record)
    expected = {("single", 1), ("single_eager", 1)} | {(m, p) for m in SPLIT for p in (1, 2, 4)}
    expected |= {("torch_cp", 2), ("torch_cp", 4)}
    assert set(rows) == expected
    for key, row in rows.items():
        if key[0] == "torch_cp":  # runs, or says why not (no invented figures)
            assert row["status"] in ("ok", "not run"), row
            assert row["status"] == "ok" or row["reason"]
            assert "peak" in row or "not run" in proc.stdout
        else:
            assert row["status"] == "ok", row
    for title in ("act. peak/rank", "longest S within", "closed form"):
        assert title in proc.stdout


def test_memory_shrinks_with_the_ranks(quick: tuple[Any, dict[str, Any]]) -> None:
    rows = _rows(quick[1])
    single = rows[("single", 1)]["peak"]
    assert single > 0 and rows[("single", 1)]["peak_vs_single"] == 1.0
    for mode in SEQUENCE:
        peaks = [rows[(mode, p)]["peak"] for p in (1, 2, 4)]
        assert peaks[0] > peaks[1] > peaks[2] > 0, (mode, peaks)
        for p in (2, 4):
            row = rows[(mode, p)]
            assert 0 < row["peak_vs_single"] < 20 and 0 < row["peak_vs_1rank_times_p"] < 4
            assert row["longest"]["seq"] >= rows[(mode, 1)]["longest"]["seq"]
    # ring self-attention splits every activation: exactly 1/P
    for p in (2, 4):
        assert rows[("rsa", p)]["peak_vs_1rank_times_p"] == pytest.approx(1.0, rel=0.05)


def test_traffic_equals_the_closed_forms(quick: tuple[Any, dict[str, Any]]) -> None:
    rows = _rows(quick[1])
    for mode in SPLIT:
        assert rows[(mode, 1)]["comm"]["sent"] == 0
        for p in (2, 4):
            comm = rows[(mode, p)]["comm"]
            assert comm["sent"] > 0
            assert comm["measured_vs_closed_form"] == pytest.approx(1.0, rel=0.10), (mode, p)
            synced = mode in SEQUENCE  # replicated parameters: a gradient all-reduce
            assert (comm["grad_sync_sent"] > 0) == synced
