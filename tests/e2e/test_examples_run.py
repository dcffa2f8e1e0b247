"""The Booster tutorial examples run under ``kolossos run`` on 2 processes, as a user starts them.

Each test starts ``python -m kolossos.cli.main run --nproc_per_node 2 examples/<name>.py`` in a
subprocess (one thread per rank, synthetic CIFAR-10, a free master port), then checks the exit
code and the lines the tutorial shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 900  # only detects a hang (a run takes ~10 s): tests never gate on speed


def run_example(name: str, tmp_path: Path, *script_args: str) -> str:
    """Run ``examples/<name>`` on 2 local processes; return its output (stdout and stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DATA=str(tmp_path / "data"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", "2"]
    argv += ["--master_port", str(free_port()), str(EXAMPLES / name), *script_args]
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}"
    return done.stdout


@rerun_if_address_is_in_use()
def test_gradient_accumulation_example(tmp_path: Path) -> None:
    out = run_example("gradient_accumulation_with_booster.py", tmp_path, "--batch_size", "8")
    values = re.findall(r"^iteration (\d+) - value: (\S+)$", out, flags=re.MULTILINE)
    assert [int(i) for i, _ in values] == [0, 1, 2, 3], out  # printed once, by rank 0
    first, second, third, fourth = (float(v) for _, v in values)
    assert first == second == third != fourth
    assert "The parameter is only updated in the last iteration" in out


@rerun_if_address_is_in_use()
def test_booster_api_example(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    out = run_example("booster_api.py", tmp_path, "--image_size", "32", "--output", str(ckpt))
    assert "index: model.safetensors.index.json" in out
    assert "loaded weights equal saved ones: True" in out
    shards = re.findall(r"^shard (\S+\.safetensors): ([\d.]+) MB$", out, flags=re.MULTILINE)
    assert len(shards) > 1 and all(float(mb) <= 10 for _, mb in shards), out
    files = {p.name for p in (ckpt / "model").iterdir()}
    assert files == {"model.safetensors.index.json", *(name for name, _ in shards)}
