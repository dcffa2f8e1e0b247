"""``kolossos check -i`` end to end: a real subprocess on this installation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _kolossos(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "kolossos.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )


def test_check_installation_reports_and_succeeds() -> None:
    proc = _kolossos("check", "-i")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    import torch

    for section in ("Versions", "Distributed backends", "Accelerator", "Required packages",
                    "Optional packages"):  # fmt: skip
        assert f"\n{section}\n" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for label in ("kolossos", "Python", "torch", "CUDA", "NCCL", "cuDNN", "gloo", "nccl", "mpi",
                  "name", "devices", "memory", "numpy", "transformers", "deepspeed"):  # fmt: skip
        assert label in rows, f"no {label!r} row in:\n{out}"
    assert torch.__version__ in rows["torch"]
    assert "works" in rows["gloo"]  # the real one-process init + all_reduce passed
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert rows["name"].split()[1] == expected
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith(f"kolossos is ready: torch {torch.__version__}, accelerator")


def test_check_without_flag_prints_help() -> None:
    proc = _kolossos("check")
    assert proc.returncode == 2
    assert "--installation" in proc.stdout
