"""``kolossos run`` on this machine: a real all-reduce, and no process left behind after a failure.

The launcher runs as a subprocess exactly as a user starts it. "No process left" is checked with
psutil twice: every descendant of the launcher seen while the job ran is gone, and no process on the
machine still runs the test's (uniquely named) script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kolossos.testing.network import free_port
from kolossos.testing.processes import (
    job_env,
    kolossos_cli,
    wait_for_pids,
    wait_no_survivors,
)

REPO = Path(__file__).resolve().parents[2]
GUARD = REPO / "kolossos" / "cli" / "launcher" / "guard.py"
SLEEPER = """\
import os, sys, time
rank = os.environ["RANK"]
tmp = os.path.join(sys.argv[1], f"rank{rank}.tmp")
with open(tmp, "w") as fh:
    fh.write(str(os.getpid()))
os.rename(tmp, os.path.join(sys.argv[1], f"rank{rank}.pid"))
time.sleep(120)
"""


def test_hello_dist_four_ranks() -> None:
    port = str(free_port())
    argv = [*kolossos_cli(), "run", "--nproc_per_node", "4", "--master_port", port]
    result = subprocess.run(
        [*argv, "examples/hello_dist.py"],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=900,  # only detects a hang (a run takes ~10 s): tests never gate on speed
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert sorted(line.split("/")[0] for line in lines) == [f"rank {r}" for r in range(4)]
    assert all("all_reduce(rank + 1) = 10, expected 10: OK" in line for line in lines), lines


@pytest.mark.parametrize("victim", ["rank", "launcher-sigint", "launcher-sigterm", "launcher-kill"])
def test_failure_or_signal_stops_everything(victim: str, tmp_path: Path) -> None:
    script = tmp_path / f"sleeper_{victim}.py"
    script.write_text(SLEEPER)
    argv = [*kolossos_cli(), "run", "--nproc_per_node", "3", "--master_port", str(free_port())]
    with open(tmp_path / "log.txt", "wb") as log:
        proc = subprocess.Popen(
            [*argv, str(script), str(tmp_path)],
            cwd=tmp_path,
            env=job_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tree: list[psutil.Process] = []
    try:
        pids = wait_for_pids(tmp_path, 3, proc)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert {p.pid for p in tree} >= set(pids.values())
        start = time.monotonic()
        if victim == "rank":
            os.kill(pids[1], signal.SIGKILL)
        else:
            sig = {"launcher-sigint": signal.SIGINT, "launcher-sigterm": signal.SIGTERM}
            os.kill(proc.pid, sig.get(victim, signal.SIGKILL))
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        log_text = (tmp_path / "log.txt").read_text(errors="replace")
        expected = {"rank": None, "launcher-sigint": 130, "launcher-sigterm": 143}
        expected["launcher-kill"] = -signal.SIGKILL
        if expected[victim] is None:
            assert code not in (0, None), log_text
            assert "node 0 (127.0.0.1) exited with code" in log_text
        else:
            assert code == expected[victim], log_text
        assert elapsed < 30
        # the launcher waits for its nodes, except when it was SIGKILLed: then the guard cleans up
        wait_no_survivors(script.name, tree, within_s=15 if victim == "launcher-kill" else 1)
    finally:
        if proc.poll() is None:
            proc.kill()
        wait_no_survivors(script.name, tree, within_s=0)


def test_guard_sweeps_orphans(tmp_path: Path) -> None:
    """The guard kills a grandchild in its own session when stdin closes, and after a clean exit."""
    marker = f"import time; time.sleep(61)  # {tmp_path.name}"
    spawn_orphan = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {marker!r}], start_new_session=True); "
    )
    # 1. the command exits at once, leaving an orphan: the guard sweeps it and returns 0
    cmd = [sys.executable, str(GUARD), "--grace", "1", "--", sys.executable, "-c", spawn_orphan]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE) as guard:  # stdin stays open until exit
        assert guard.wait(timeout=30) == 0
    wait_no_survivors(tmp_path.name, [], within_s=0)
    # 2. the command runs on; closing the guard's stdin stops it and its grandchild
    cmd[-1] = spawn_orphan + "time.sleep(60)"
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    tree = psutil.Process(proc.pid).children(recursive=True)
    while len(tree) < 2 and time.monotonic() < deadline:  # the child and its orphaned grandchild
        time.sleep(0.05)
        tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) == 2
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=10) == 143
    assert proc.stderr is not None and b"launcher connection closed" in proc.stderr.read()
    wait_no_survivors(tmp_path.name, tree, within_s=0)
