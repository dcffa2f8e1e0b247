"""``examples/tensor/colo_tensor_resharding.py`` (the ColoTensor concepts example, §20.18) runs on
4 processes and prints the shapes and values the resharding implies: a ``(2, 3, 1)`` piece per
rank, the replicated ``(2, 3, 2)`` tensor (both tp ranks held the same seeded piece), then the
``(1, 3, 2)`` row piece of tp rank 0 on rank 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # only detects a hang


@pytest.mark.dist
def test_colo_tensor_resharding_example(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    script = REPO / "examples" / "tensor" / "colo_tensor_resharding.py"
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out
    shapes = re.findall(r"^shape torch\.Size\((\[[\d, ]+\])\)", out, flags=re.MULTILINE)
    assert shapes == ["[2, 3, 1]", "[2, 3, 2]", "[2, 3, 2]"], out  # global shapes, rank 0 only
    local = re.findall(r"^local shape torch\.Size\((\[[\d, ]+\])\)", out, flags=re.MULTILINE)
    assert local == ["[2, 3, 1]", "[2, 3, 2]", "[1, 3, 2]"], out
    assert "placements=(Replicate(),)" in out and "placements=(Shard(dim=0),)" in out
    torch.manual_seed(0)
    piece = torch.randn(2, 3, 1)
    expected = torch.cat([piece, piece], dim=-1)[0].flatten().tolist()
    values = re.search(r"^local values \[(.*)\]$", out, flags=re.MULTILINE)
    assert values is not None, out
    got = [float(v) for v in values.group(1).split(",")]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))


def _run_demo(tmp_path: Path, nproc: int, *args: str) -> str:
    from kolossos.testing.network import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", str(nproc)]
    argv += [
        "--master_port",
        str(free_port()),
        str(REPO / "examples" / "tensor" / "train_gpt_demo.py"),
    ]
    done = subprocess.run(
        [*argv, "--vocab_size", "128", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout
    steps = re.findall(
        r"^\[(\d)/4\] Loss:([\d.]+), Step time: [\d.]+s, TFLOPS: [\d.]+$",
        done.stdout,
        flags=re.MULTILINE,
    )
    assert [int(s) for s, _ in steps] == [1, 2, 3, 4], done.stdout
    assert all(0.0 < float(v) < 10.0 for _, v in steps)
    assert re.search(r"^Median TFLOPS is [\d.]+$", done.stdout, flags=re.MULTILINE), done.stdout
    return done.stdout


@pytest.mark.dist
def test_gpt_demo_gemini_tp1(tmp_path: Path) -> None:
    out = _run_demo(tmp_path, 2, "--placement", "cpu")
    assert "tp 1, world 2" in out


@pytest.mark.dist
def test_gpt_demo_gemini_tp2_shardinit(tmp_path: Path) -> None:
    out = _run_demo(tmp_path, 4, "--placement", "cpu", "--tp_degree", "2", "--shardinit")
    assert "tp 2, world 4" in out


@pytest.mark.dist
def test_gpt_demo_colo_tp2(tmp_path: Path) -> None:
    out = _run_demo(tmp_path, 4, "--distplan", "colo_tp", "--tp_degree", "2")
    assert "tp 2, world 4" in out
