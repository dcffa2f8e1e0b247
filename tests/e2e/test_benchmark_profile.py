"""``python -m benchmarks profile`` end to end on a tiny model: every category and the kernel
counters per row, the floor row (forward + backward only) beside a ZeRO row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 600  # a hang detector: ~5 s on an idle 2-core machine


def test_profile_floor_and_zero2(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks", "profile", "--model", "gpt2-tiny", "--rows",
           "floor,kolossos-zero2", "--steps", "2", "--warmup", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| proc CPU | sys | faults (k) |" in proc.stdout
    per_rank = json.loads(out.read_text())["per_rank"]
    assert len(per_rank) == 2
    for rank in per_rank:
        floor, zero2 = rank["floor"], rank["kolossos-zero2"]
        for row in (floor, zero2):
            assert row["wall"] > 0 and row["fwd"] > 0 and row["bwd"] > 0
            assert row["proc_cpu"] >= row["proc_sys"] >= 0 and row["faults"] >= 0
        assert floor["comm"] == 0 and floor["optim"] == 0  # no communication, no optimizer
        assert zero2["comm"] > 0 and zero2["optim"] > 0
