"""``python -m benchmarks.gemini_capacity --device cpu`` end to end at toy size: the limit is
stated, both modes train (Gemini from a lazily built model), the summary relates them (never
timings). The GPU run is the same code with ``--device cuda``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ sits beside the package, not installed with it
    sys.path.insert(0, str(ROOT))

from benchmarks.gemini_capacity import gpt2_params, layers_for, mount_type  # noqa: E402

HANG_S = 600  # detects a hang only: ~10 s on a loaded 2-core machine


def test_layer_counts_follow_the_parameter_budget() -> None:
    for layers in (1, 7, 40):
        params = gpt2_params(layers, 256, 128)
        assert layers_for(params, 256, 128) == layers
        assert layers_for(params - 1, 256, 128) == max(1, layers - 1)


def run(*args: str) -> list[dict]:
    """Run the benchmark on the CPU at toy size; return its JSON lines."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "benchmarks.gemini_capacity", "--device", "cpu"]
    cmd += ["--hidden", "64", "--heads", "4", "--seq", "32", *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]


def test_cpu_smoke_run() -> None:
    pytest.importorskip("transformers")
    lines = run("--ddp-layers", "1", "--gemini-layers", "2")
    limit = lines[0]["limit"]
    assert limit["bytes_per_param"] == 16 and limit["ddp_limit_params"] > 0
    rows = {row["mode"]: row for row in lines[1:3]}
    assert rows["ddp"]["ok"] and rows["gemini"]["ok"], rows
    assert 0 < lines[0]["placement_bound"] < 1
    # the optimizer data went to the "device" (on a CPU the host itself) before the first step
    assert rows["gemini"]["optim_on_device_gib"] > 0 and rows["ddp"]["optim_on_device_gib"] is None
    assert rows["ddp"]["params"] == gpt2_params(1, 64, 32)
    assert rows["gemini"]["params"] == gpt2_params(2, 64, 32)
    summary = lines[3]
    assert summary["gemini_over_ddp"] == round(gpt2_params(2, 64, 32) / gpt2_params(1, 64, 32), 2)
    assert 0 < summary["gemini_of_limit"] < 1


def test_nvme_mode_streams_states_to_the_given_directory(tmp_path: Path) -> None:
    """``gemini-nvme`` trains with a share of the Adam states in files under ``--nvme-dir``
    (all of them here: the toy model's states fit 0.9 of any free disk) and states the limit
    with the disk counted."""
    pytest.importorskip("transformers")
    nvme = str(tmp_path / "nvme")
    lines = run("--modes", "gemini-nvme", "--gemini-nvme-layers", "2", "--nvme-dir", nvme)
    limit = lines[0]["limit"]
    assert limit["disk_free_gib"] > 0
    assert limit["gemini-nvme_limit_params"] > limit["gemini_limit_params"]
    row, summary = lines[1], lines[2]
    assert row["mode"] == "gemini-nvme" and row["ok"], row
    assert row["nvme_offload_fraction"] == 1.0 and row["params"] == gpt2_params(2, 64, 32)
    assert summary["largest_params"] == {"gemini-nvme": row["params"]}
    assert summary["gemini-nvme_of_gemini_limit"] > 0


def test_nvme_mode_refuses_memory_file_systems() -> None:
    if mount_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    cmd = [sys.executable, "-m", "benchmarks.gemini_capacity", "--device", "cpu", "--modes"]
    cmd += ["gemini-nvme", "--nvme-dir", "/dev/shm/kolossos-nvme"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT, check=False
    )
    assert proc.returncode == 2 and "is on tmpfs, which is memory, not a disk" in proc.stderr


def test_rejects_a_steady_cap_outside_the_unit_interval() -> None:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gemini_capacity",
        "--device",
        "cpu",
        "--steady-cap",
        "1.5",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT, check=False
    )
    assert proc.returncode == 2 and "--steady-cap 1.5 must lie in (0, 1]" in proc.stderr
