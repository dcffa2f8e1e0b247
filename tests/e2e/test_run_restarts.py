"""``kolossos run --max_restarts K`` on this machine: a failed job is relaunched whole, each attempt
knows its number (``KOLOSSOS_RESTART_COUNT``), and the restarts stop at K, at a success, or at a
Ctrl-C. (Dropping nodes that no longer answer is tested over ssh in ``test_run_ssh.py``.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

from kolossos.testing.network import free_port
from kolossos.testing.processes import job_env, kolossos_cli

HANG_S = 600  # only detects a hang
SCRIPT = """\
import os, sys
import torch, torch.distributed as dist
import kolossos

kolossos.launch_from_torch(config={}, verbose=False)
attempt = int(os.environ["KOLOSSOS_RESTART_COUNT"])
with open(os.path.join(sys.argv[1], f"attempt{attempt}.rank{dist.get_rank()}"), "w") as fh:
    fh.write(str(dist.get_world_size()))
t = torch.ones(1)
dist.all_reduce(t)
if attempt < int(sys.argv[2]) and dist.get_rank() == 1:
    raise RuntimeError(f"injected failure in attempt {attempt}")
dist.all_reduce(t)
"""


def _run(tmp_path: Path, failures: int, max_restarts: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    argv = [*kolossos_cli(), "run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    return subprocess.run(
        [*argv, "--max_restarts", str(max_restarts), str(script), str(tmp_path), str(failures)],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


def _attempts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("attempt*"))


def test_a_failed_job_is_relaunched_until_it_succeeds(tmp_path: Path) -> None:
    done = _run(tmp_path, failures=2, max_restarts=3)
    assert done.returncode == 0, done.stderr
    assert _attempts(tmp_path) == [f"attempt{a}.rank{r}" for a in range(3) for r in range(2)]
    assert "the job failed with exit code 1; restart 1 of 3" in done.stderr
    assert "restart 2 of 3" in done.stderr and "restart 3 of 3" not in done.stderr
    assert "kolossos: rank 1 failed at job.py:12 in <module>" in done.stderr, done.stderr


def test_restarts_stop_at_the_limit(tmp_path: Path) -> None:
    done = _run(tmp_path, failures=5, max_restarts=1)
    assert done.returncode == 1, done.stderr
    assert _attempts(tmp_path) == [f"attempt{a}.rank{r}" for a in range(2) for r in range(2)]
    assert "restart 1 of 1" in done.stderr and "restart 2" not in done.stderr


def test_without_max_restarts_a_failure_ends_the_job(tmp_path: Path) -> None:
    done = _run(tmp_path, failures=1, max_restarts=0)
    assert done.returncode == 1
    assert _attempts(tmp_path) == ["attempt0.rank0", "attempt0.rank1"]
    assert "restart 1" not in done.stderr


def test_a_negative_max_restarts_is_refused(tmp_path: Path) -> None:
    done = _run(tmp_path, failures=0, max_restarts=-1)
    assert done.returncode == 2
    assert "--max_restarts -1 is invalid" in done.stderr and "pass 0" in done.stderr
    assert _attempts(tmp_path) == []
