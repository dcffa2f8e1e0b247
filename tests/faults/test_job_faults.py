"""Fault injection on real ``kolossos train`` jobs (2 processes, in subprocesses), as an operator
meets them: an I/O error on rank 0 only, a rank killed mid-step, the disk full during a save, a
corrupted checkpoint file. Each job must stop cleanly in seconds (not at the 600 s collective
timeout), say which rank failed and why, leave no process behind, and lose nothing: the last
complete checkpoint still resumes.

The time from the fault to the end of the job is printed (``-s`` shows it); it is reported in
``docs/reliability.md`` and never asserted beyond the hang limit.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from kolossos.train.metrics import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HANG_S = 900  # only detects a hang: tests never gate on speed
TINY = [
    "name=tiny",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.eval_interval=1000",
    "train.eval_batches=1",
    "train.log_interval=1",
    "checkpoint.every=3",
    "checkpoint.keep_last=2",
    "sample.tokens=8",
]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _train(out: Path, *args: str, **popen: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kolossos.cli.train", *TINY, f"output_dir={out}", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=HANG_S,
        **popen,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 6 steps with checkpoints after steps 3 and 6, copied by each test."""
    out = tmp_path_factory.mktemp("base")
    done = _train(out, "train.steps=6")
    assert done.returncode == 0, done.stderr
    return out


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    return out


def _resumes(out: Path, steps: int = 7) -> None:
    """The run still finishes from its last complete checkpoint."""
    done = _train(out, f"train.steps={steps}", "--resume")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and f"finished {steps} steps" in done.stdout, done.stdout


def test_an_io_error_on_rank_0_only_ends_the_job_in_seconds(finished: Path, tmp_path: Path) -> None:
    out = _copy(finished, tmp_path)
    metrics = out / "tiny" / "metrics.jsonl"
    metrics.unlink()
    metrics.mkdir()  # rank 0 alone writes metrics: its open fails, rank 1 is already training
    began = time.monotonic()
    done = _train(out, "train.steps=9", "--resume")
    took = time.monotonic() - began
    print(f"\nI/O error on rank 0: job ended after {took:.1f} s (start-up included)")
    assert done.returncode != 0
    assert "rank 0 failed at kolossos/train/metrics.py" in done.stderr, done.stderr
    assert "IsADirectoryError" in done.stderr and "Timed out" not in done.stderr, done.stderr
    assert "ChildFailedError" not in done.stderr, done.stderr  # torch elastic's noise is dropped
    assert (out / "tiny" / ".failures" / "rank_00000.json").is_file()
    metrics.rmdir()
    _resumes(out)


def _workers(root: psutil.Process) -> list[psutil.Process]:
    """The rank processes: the children of torch's elastic agent below ``root``."""
    agents = [p for p in root.children(recursive=True) if "torch.distributed.run" in p.cmdline()]
    return [
        child
        for agent in agents
        for child in agent.children()
        if "kolossos.train.worker" in child.cmdline()
        and "torch.distributed.run" not in child.cmdline()  # torch's own helper process
    ]


@dataclass
class Killed:
    """What a job did after one of its ranks was SIGKILLed."""

    code: int
    output: str
    after_s: float
    victims: list[psutil.Process]


def _kill_a_rank(
    out: Path, args: list[str], when: Callable[[list[str]], bool], victim: int = 1
) -> Killed:
    """Start ``kolossos train`` with ``args``, SIGKILL rank ``victim`` once ``when(lines so
    far)`` holds (polled every 2 ms), and wait for the job to end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kolossos.cli.train", *TINY, f"output_dir={out}", *args],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + HANG_S
        while not when(lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.002)
        victims = _workers(psutil.Process(proc.pid))
        assert len(victims) == 2
        killed_at = time.monotonic()
        victims[victim].send_signal(signal.SIGKILL)
        proc.wait(timeout=HANG_S)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=60)
    return Killed(proc.returncode, "".join(lines), took, victims)


def _trained(lines: list[str], step: int) -> bool:
    return any((m := re.search(r"step\s+(\d+)/", line)) and int(m[1]) >= step for line in lines)


def test_a_rank_killed_mid_step_ends_the_job_and_leaves_no_process(
    finished: Path, tmp_path: Path
) -> None:
    out = _copy(finished, tmp_path)
    killed = _kill_a_rank(out, ["train.steps=100000", "--resume"], lambda ls: _trained(ls, 8))
    print(f"\nrank killed mid-step: job ended {killed.after_s:.1f} s later")
    assert killed.code != 0
    assert "Timed out" not in killed.output, killed.output
    assert not [p for p in killed.victims if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    _resumes(out)


def test_with_max_restarts_a_killed_rank_costs_only_the_steps_since_the_checkpoint(
    finished: Path, tmp_path: Path
) -> None:
    out = _copy(finished, tmp_path)
    args = ["train.steps=60", "--resume", "--max_restarts", "1"]  # killed long before the end
    killed = _kill_a_rank(out, args, lambda ls: _trained(ls, 10))
    print(
        f"\nrank killed, --max_restarts 1: the job went on and ended {killed.after_s:.1f} s later"
    )
    assert killed.code == 0, killed.output
    text = killed.output
    assert "the job failed with exit code 1; restart 1 of 1" in text, text
    resumed = re.search(r"restarting from \S*step_0*(\d+) \(step (\d+)\)", text)
    assert resumed and resumed[1] == resumed[2] and int(resumed[1]) >= 9, text  # every 3 steps
    assert "finished 60 steps" in text, text
    steps = [
        r["step"] for r in read_metrics(out / "tiny" / "metrics.jsonl") if r["kind"] == "train"
    ]
    assert steps == list(range(1, 61))  # the replayed steps replace the lost ones


def test_a_rank_killed_during_an_async_save_keeps_the_previous_checkpoint(
    finished: Path, tmp_path: Path
) -> None:
    out = _copy(finished, tmp_path)
    checkpoints = out / "tiny" / "checkpoints"
    args = ["train.steps=100000", "--resume", "checkpoint.async=true", "checkpoint.every=2"]

    def saving(lines: list[str]) -> bool:  # a checkpoint after the resumed one is in flight
        return _trained(lines, 8) and any(
            p.name.endswith(".partial") for p in checkpoints.iterdir()
        )

    killed = _kill_a_rank(out, args, saving, victim=0)
    print(f"\nrank killed during an async save: job ended {killed.after_s:.1f} s later")
    assert killed.code != 0 and "Timed out" not in killed.output, killed.output
    complete = [p.name for p in checkpoints.iterdir() if not p.name.startswith(".")]
    assert complete and all((checkpoints / n / "trainer_state.json").is_file() for n in complete)
    _resumes(out, steps=max(int(n.removeprefix("step_")) for n in complete) + 1)


def _limit_file_size() -> None:  # runs in the child: no file may grow beyond 64 KiB
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(
    finished: Path, tmp_path: Path
) -> None:
    out = _copy(finished, tmp_path)
    began = time.monotonic()
    done = _train(out, "train.steps=9", "--resume", preexec_fn=_limit_file_size)
    took = time.monotonic() - began
    print(f"\ndisk full during a save: job ended after {took:.1f} s (start-up included)")
    assert done.returncode != 0
    assert "File too large" in done.stderr and "Timed out" not in done.stderr, done.stderr
    kept = sorted(p.name for p in (out / "tiny" / "checkpoints").iterdir())
    assert kept == ["step_000003", "step_000006"], kept  # nothing half-written is visible
    _resumes(out)


def test_a_corrupted_model_shard_is_named_and_nothing_else_is_touched(
    finished: Path, tmp_path: Path
) -> None:
    out = _copy(finished, tmp_path)
    last = out / "tiny" / "checkpoints" / "step_000006"
    shard = next((last / "model").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    began = time.monotonic()
    done = _train(out, "train.steps=9", "--resume")
    took = time.monotonic() - began
    print(f"\ncorrupted model shard: job ended after {took:.1f} s (start-up included)")
    assert done.returncode != 0
    assert shard.name in done.stderr and "Timed out" not in done.stderr, done.stderr
    assert (out / "tiny" / "checkpoints" / "step_000003").is_dir()  # the older one is kept
