"""Process helpers for end-to-end tests of the command line: find the ``kolossos`` program, give a
job a quiet environment, run a module of the checkout, wait for ranks to start, and prove that no
process survived a job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

#: the checkout this package was imported from (tests run the launcher against it)
REPO = Path(__file__).resolve().parents[2]


def kolossos_cli() -> list[str]:
    """The installed ``kolossos`` console script, else ``python -m kolossos.cli.main``."""
    script = shutil.which("kolossos", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "kolossos.cli.main"]


def job_env() -> dict[str, str]:
    """The environment of a launched job: one thread per rank, this checkout importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` from the checkout in :func:`job_env`, output captured as text;
    ``timeout`` (seconds) is a hang detector."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=job_env(), cwd=REPO, check=False)  # fmt: skip


def wait_for_pids(folder: Path, count: int, proc: subprocess.Popen[bytes]) -> dict[int, int]:
    """Wait until ``count`` ranks wrote ``rank<R>.pid``; return ``{rank: pid}``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = sorted(folder.glob("rank*.pid"))
        if len(files) == count:
            return {int(f.stem[4:]): int(f.read_text()) for f in files}
        assert proc.poll() is None, f"launcher ended early with code {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"only {len(list(folder.glob('rank*.pid')))}/{count} ranks started")


def survivors(marker: str, tree: list[psutil.Process]) -> list[psutil.Process]:
    """Live (non-zombie) processes of ``tree``, plus any process whose cmdline holds ``marker``."""
    found = {}
    for proc in [*tree, *psutil.process_iter()]:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc in tree or marker in " ".join(proc.cmdline()):
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(found.values())


def wait_no_survivors(marker: str, tree: list[psutil.Process], within_s: float) -> None:
    """Assert that every process of ``tree`` / with ``marker`` is gone within ``within_s``."""
    deadline = time.monotonic() + within_s
    left = survivors(marker, tree)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = survivors(marker, tree)
    for proc in left:  # do not leak them into the rest of the test session
        proc.kill()
    assert not left, [" ".join(p.cmdline()) for p in left if p.is_running()]
