"""Stuck and failing ranks of ``kolossos run`` jobs (2 real processes, gloo), as an operator meets
them: a rank that sleeps after its peers finished, a rank that never reaches a collective its
peer waits in, a collective timeout, an exception on one rank while the other waits.

Each job must end in seconds, not at the collective timeout, and name the rank at fault: the
progress watchdog (``--watchdog``) prints the stuck rank's Python stack; a timeout or a lost peer
prints every rank's last collective from torch's flight recorder. The time from the launch to
the end of the job is printed (``-s``) and reported in ``docs/reliability.md``; it is never
asserted beyond the hang limit.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from kolossos.testing.network import free_port
from kolossos.testing.processes import job_env, kolossos_cli

HANG_S = 600  # only detects a hang: tests never gate on speed
SCRIPT = """\
import os, sys, time
import torch, torch.distributed as dist
import kolossos

kolossos.launch_from_torch(config={}, verbose=False, timeout=float(os.environ.get("T", "600")))
mode, rank = sys.argv[1], dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)  # collective #1: every rank
if mode == "sleep-after-peers-exit" and rank == 1:
    time.sleep(3600)  # the straggler's line
if mode == "sleep-before-collective" and rank == 1:
    time.sleep(3600)  # the straggler's line
if mode == "raise-while-peer-waits" and rank == 1:
    raise ValueError("a bad batch on rank 1")
if mode != "sleep-after-peers-exit":
    dist.all_reduce(t)  # collective #2: rank 0 waits here for rank 1
print(f"rank {rank} done", flush=True)
"""


def _run(
    tmp_path: Path, mode: str, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    argv = [*kolossos_cli(), "run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    began = time.monotonic()
    done = subprocess.run(
        [*argv, *flags, str(script), mode],
        env={**job_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    return done, time.monotonic() - began


@pytest.mark.parametrize("mode", ["sleep-after-peers-exit", "sleep-before-collective"])
def test_the_watchdog_ends_a_stuck_rank_with_its_stack(tmp_path: Path, mode: str) -> None:
    done, took = _run(tmp_path, mode, "--watchdog", "3")
    print(f"\nwatchdog, {mode}: job ended after {took:.1f} s (start-up included)")
    assert done.returncode != 0, done.stderr
    err = done.stderr
    assert "exitcode: 124" in err, err  # the watchdog's code, reported by torch elastic
    assert "kolossos watchdog: rank 1 (host" in err and "made no progress for" in err, err
    assert 'job.py", line 10' in err or 'job.py", line 12' in err, err  # the sleeping line
    if mode == "sleep-after-peers-exit":
        assert "while rank(s) 0 finished" in err, err
        assert "rank 0 done" in done.stdout
    else:
        assert "rank 0 started collective #2 (gloo:all_reduce)" in err, err
        assert "which rank 1 never entered (its last there: #1)" in err, err
        assert "rank 1: #1 gloo:all_reduce" in err and "<- behind" in err, err


def test_a_collective_timeout_prints_every_ranks_last_collective(tmp_path: Path) -> None:
    done, took = _run(tmp_path, "sleep-before-collective", env={"T": "4"})
    print(f"\ncollective timeout (4 s): job ended after {took:.1f} s (start-up included)")
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "kolossos: rank 0 failed at" in err and "Timed out" in err, err
    assert "last collective of every rank (torch flight recorder):" in err, err
    assert "rank 0: #2 gloo:all_reduce" in err and "rank 1: #1 gloo:all_reduce" in err, err
    assert "rank 1 is behind: rank 0 started collective #2" in err, err


def test_an_exception_on_one_rank_ends_the_job_with_its_report(tmp_path: Path) -> None:
    done, took = _run(tmp_path, "raise-while-peer-waits")
    print(f"\nexception on rank 1: job ended after {took:.1f} s (start-up included)")
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "kolossos: rank 1 failed at job.py:14 in <module>: ValueError: a bad batch" in err, err
    assert "Timed out" not in err, err


@pytest.mark.parametrize(
    ("value", "needle"),
    [("abc", "--watchdog='abc' is not a number of seconds"), ("-1", "--watchdog='-1'")],
)
def test_a_bad_watchdog_value_is_refused_before_launch(
    tmp_path: Path, value: str, needle: str
) -> None:
    done, _ = _run(tmp_path, "sleep-after-peers-exit", "--watchdog", value)
    assert done.returncode == 2 and needle in done.stderr, done.stderr
    assert "or 0 to turn the watchdog off" in done.stderr


def test_a_bad_watchdog_variable_fails_launch_before_the_rendezvous(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, "sleep-after-peers-exit", env={"KOLOSSOS_WATCHDOG": "soon"})
    assert done.returncode != 0
    assert "KOLOSSOS_WATCHDOG='soon' is not a number of seconds" in done.stderr, done.stderr
