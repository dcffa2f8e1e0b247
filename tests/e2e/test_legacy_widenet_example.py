"""The MoE WideNet example (``examples/legacy/widenet``, CHECKLIST §20.17) runs under
``kolossos run --nproc_per_node 2`` as a user starts it: ``parallel = dict(moe=dict(size=2))``
builds MOE_MODEL / MOE_DATA, ``kolossos.initialize`` adds ``MoeGradientHandler`` by itself, the
loss falls, replicas agree and the two ranks hold different experts (the script's own
exit-code check)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "examples" / "legacy" / "widenet"
TIMEOUT_S = 900  # only detects a hang (a run takes seconds): tests never gate on speed
FLOAT = r"[-+]?\d+\.\d+(?:e[-+]?\d+)?"


@rerun_if_address_is_in_use()
def test_widenet_example(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", "2"]
    argv += ["--master_port", str(free_port()), str(FOLDER / "train.py")]
    argv += ["--config", str(FOLDER / "config.py")]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, f"exit code {done.returncode}\n{out}"
    assert "MOE_MODEL groups of 2: this rank in [0, 1], MOE_DATA [0]" in out
    assert "gradient handlers: ['MoeGradientHandler']" in out
    found = re.findall(rf"\[rank 0\] step (\d+) / 20 \| train loss ({FLOAT})", out)
    assert [int(i) for i, _ in found] == list(range(1, 21)), out
    assert (
        "dense parameters identical on all ranks: True; experts identical over MOE_DATA: True; "
        "experts differ over MOE_MODEL: True; loss fell: True"
    ) in out
