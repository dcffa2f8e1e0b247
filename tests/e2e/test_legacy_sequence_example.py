"""The sequence-parallel BERT example (``examples/legacy/sequence_parallel``) runs under
``kolossos run --nproc_per_node 2``, as a user starts it: ring self-attention over
``ParallelMode.SEQUENCE``, ``SequenceParallelGradientHandler``, the loss falling and the ranks
ending with the same parameters (the script's own exit-code check)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "examples" / "legacy" / "sequence_parallel"
TIMEOUT_S = 900  # only detects a hang (a run takes a few seconds): tests never gate on speed
FLOAT = r"[-+]?\d+\.\d+(?:e[-+]?\d+)?"


def run_example(tmp_path: Path) -> str:
    """Run the example on 2 local processes from an unrelated directory; return its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", "2"]
    argv += ["--master_port", str(free_port()), str(FOLDER / "train.py")]
    argv += ["--config", str(FOLDER / "config.py")]
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
def test_sequence_parallel_example(tmp_path: Path) -> None:
    out = run_example(tmp_path)
    assert "sequence parallel size 2, data parallel size 1" in out
    assert "gradient handlers: ['SequenceParallelGradientHandler']" in out
    found = re.findall(rf"\[rank 0\] step (\d+) / 20 \| train loss ({FLOAT})", out)
    assert [int(i) for i, _ in found] == list(range(1, 21)), out  # logged once, by rank 0
    losses = [float(x) for _, x in found]
    assert losses[-1] < 0.8 * losses[0]
    assert "parameters identical on all ranks: True; loss fell: True" in out
