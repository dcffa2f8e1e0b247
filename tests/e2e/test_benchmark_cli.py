"""``kolossos benchmark`` as a user runs it (CHECKLIST §2.3, issue #22): ``--nproc 4`` and
``--nproc 8`` at tiny sizes in subprocesses, each printing a row for every layout the count
allows, with a time, a peak memory and a byte count, and writing the same figures as JSON; the
bytes are those of the algorithms, so a second run counts the same. And the worker's failure
path: a layout that raises on every rank is reported and the next one still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kolossos.cli.benchmark.layouts import Layout
from kolossos.cli.benchmark.options import BenchmarkOptions
from kolossos.cli.benchmark.report import LayoutResult, format_table
from kolossos.cli.benchmark.worker import run_layouts
from kolossos.testing import spawn

REPO = Path(__file__).resolve().parents[2]
HANG_S = 600  # subprocess limits only detect hangs: tests never gate on speed
TINY = ["--batch_size", "8", "--seq_len", "2", "--dimension", "16", "--layers", "1",
        "--warmup_steps", "1", "--profile_steps", "1"]  # fmt: skip
EXPECTED = {
    4: ["data", "1d", "2d", "2.5d-depth1"],
    8: ["data", "1d", "2.5d-depth2", "3d"],
}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_benchmark(nproc: int, folder: Path) -> tuple[str, dict[str, Any]]:
    """The command's stdout and its JSON file."""
    path = folder / f"bench{nproc}.json"
    done = subprocess.run(
        [sys.executable, "-m", "kolossos.cli.main", "benchmark", "--nproc", str(nproc), *TINY,
         "--json", str(path)],
        cwd=folder, env=_env(), capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(path.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("benchmark")
    out = {nproc: run_benchmark(nproc, folder) for nproc in EXPECTED}
    for nproc, (stdout, _) in out.items():  # what the docs show (pytest -s)
        print(f"$ kolossos benchmark --nproc {nproc} {' '.join(TINY)}\n{stdout}")
    return out


def _rows(stdout: str) -> dict[str, list[str]]:
    """Table rows by label: the lines between the column header and the blank line after."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        label = line.split("  ")[0].strip()
        rows[label] = line[len(label) :].split()
    return rows


@pytest.mark.parametrize("nproc", sorted(EXPECTED))
def test_every_layout_reports_time_memory_and_bytes(
    runs: dict[int, tuple[str, dict[str, Any]]], nproc: int
) -> None:
    stdout, payload = runs[nproc]
    layouts = payload["layouts"]
    assert [entry["layout"]["name"] for entry in layouts] == EXPECTED[nproc]
    assert payload["environment"]["backend"] in ("gloo", "nccl")
    rows = _rows(stdout)
    assert list(rows) == [entry["layout"]["label"] for entry in layouts]
    for entry in layouts:
        assert entry["status"] == "ok", entry
        assert entry["step_ms"]["mean"] > 0 and entry["step_ms"]["std"] >= 0
        assert entry["forward_ms"] > 0 and entry["backward_ms"] > 0
        assert entry["peak_memory_bytes"] > 0
        # every layout communicates: DDP's gradient all-reduce, or the tensor-parallel layers'
        assert entry["comm_bytes_per_step"] > 0, entry["layout"]
        assert len(entry["per_rank"]["comm_bytes"]) == nproc
        cells = rows[entry["layout"]["label"]]
        assert cells[0] == entry["layout"]["grid"] and cells[-1] == "ok"
        float(cells[1]), float(cells[3]), float(cells[4]), float(cells[5])  # times are numbers


@pytest.mark.parametrize("nproc", sorted(EXPECTED))
def test_json_matches_the_table(runs: dict[int, tuple[str, dict[str, Any]]], nproc: int) -> None:
    stdout, payload = runs[nproc]
    options = BenchmarkOptions.from_dict(payload["options"])
    assert options.nproc == nproc and options.dimension == 16
    results = [LayoutResult(**entry) for entry in payload["layouts"]]
    expected = format_table(results, options, payload["environment"])
    assert stdout.rstrip("\n") == expected


def test_bytes_repeat_exactly_and_memory_closely(
    runs: dict[int, tuple[str, dict[str, Any]]], tmp_path: Path
) -> None:
    _, first = runs[4]
    _, second = run_benchmark(4, tmp_path)
    for a, b in zip(first["layouts"], second["layouts"], strict=True):
        assert a["per_rank"]["comm_bytes"] == b["per_rank"]["comm_bytes"], a["layout"]["name"]
        assert a["comm_calls_per_step"] == b["comm_calls_per_step"]
        if a["memory_source"] == "tracker":  # tensor storages counted exactly on the CPU, but
            # which temporaries overlap at the peak depends on when a collective completes (one
            # rank once measured 256 B more): equal within a few hundred bytes
            for x, y in zip(a["per_rank"]["peak_memory_bytes"], b["per_rank"]["peak_memory_bytes"],
                            strict=True):  # fmt: skip
                assert abs(x - y) <= 512, (a["layout"]["name"], x, y)


def _failing_then_working(rank: int, world_size: int, port: int) -> list[dict[str, Any]]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="localhost", MASTER_PORT=str(port))  # fmt: skip
    options = BenchmarkOptions(nproc=world_size, batch_size=8, seq_len=2, dimension=2, layers=1,
                               warmup_steps=0, profile_steps=1)  # fmt: skip
    # 2D needs the hidden size to divide by q*q = 4: Linear2D(2, 2) raises on every rank
    layouts = [Layout(mode="2d", nproc=world_size, q=2), Layout(mode=None, nproc=world_size)]
    return run_layouts(layouts, options, None)


@pytest.mark.dist
def test_worker_records_a_failing_layout_and_runs_the_next() -> None:
    done = spawn(_failing_then_working, 4)[0]
    failed, worked = done
    assert [r["error"] is not None for r in failed["ranks"]] == [True] * 4
    assert "out_features" in failed["ranks"][0]["error"]
    assert [r["error"] for r in worked["ranks"]] == [None] * 4
    assert all(r["comm_bytes"] > 0 for r in worked["ranks"])
