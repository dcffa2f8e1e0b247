"""``python -m benchmarks --quick`` end to end, so the benchmarks never rot; plus the pure helpers
that turn measurements into ratios and tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DDP_ROWS = {"torch-ddp", "kolossos-ddp", "single", "fsdp2"}
HANG_S = 900


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # no delegation to .venv-bench: DeepSpeed runs only if this interpreter has it
        "KOLOSSOS_BENCH_VENV": "",
    }
    # The limit only detects a hang: ~40 s on an idle 2-core machine, and it failed at 115 s on a
    # loaded one (tests never gate on speed).
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    return proc, out


def test_quick_run_prints_table_and_json_lines(quick_run: tuple[Any, Path]) -> None:
    proc, out = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "contender" in proc.stdout and "vs torch-ddp" in proc.stdout
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and "--quick" in saved["meta"]["argv"]
    suites = {r["suite"] for r in rows}
    from benchmarks.suites import SUITES

    assert suites == set(SUITES)  # every registered suite reports rows: nothing silently dropped
    for row in rows:
        assert row["status"] in ("ok", "skipped"), row
        if row["status"] == "skipped":
            assert row["reason"]
    ddp = [r for r in rows if r["suite"] == "ddp"]
    assert {r["model"] for r in ddp} == {"gpt2-tiny", "resnet-tiny", "vit-tiny"}
    assert {r["name"] for r in ddp if r["status"] == "ok"} == DDP_ROWS


def test_quick_run_figures_are_consistent(quick_run: tuple[Any, Path]) -> None:
    proc, _ = quick_run
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for row in (r for r in rows if r["suite"] == "ddp" and r["status"] == "ok"):
        assert row["throughput"] > 0 and len(row["throughput_reps"]) == row["reps"]
        assert len(row["slots"]["throughput"]) == row["reps"] * row["steps"]
        assert row["cpu_s_per_step"] > 0
        assert row["step_time_s"]["p10"] <= row["step_time_s"]["median"]
        mem, comm = row["memory"], row["comm"]
        assert mem["source"] in ("tracker", "allocator")
        assert len(mem["peak_per_rank"]) == row["ranks"]
        if row["name"] in ("torch-ddp", "kolossos-ddp", "single"):
            assert mem["model_states_vs_estimate"] == pytest.approx(1.0, rel=0.05)
        if row["name"] in ("torch-ddp", "kolossos-ddp"):
            assert comm["wire_vs_formula"] == pytest.approx(1.0, rel=0.05)
            assert set(row["ratios"]) == {"torch-ddp", "single"} - {row["name"]}
            assert set(row["cpu_ratios"]) == set(row["ratios"])
        if row["name"] == "single":
            assert comm["bytes_per_step"] == 0 and row["ranks"] == 1


# --- pure helpers --------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _benchmarks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/ is a top-level folder of the repository, not part of the installed package
    monkeypatch.syspath_prepend(str(ROOT))


def _row(name: str, walls: list[float], status: str = "ok", units: int = 10) -> dict[str, Any]:
    from benchmarks.results import _timing

    row = {"name": name, "status": status}
    if status == "ok":  # two ranks, one repetition; rank 1 always the slower one here
        entry = {"wall": walls, "cpu": [2 * w for w in walls]}
        slow = {"wall": [w + 1 for w in walls], "cpu": [2 * w for w in walls]}
        row.update(_timing([[entry, slow]], units))
    return row


def test_ratios_pair_neighbouring_steps() -> None:
    from benchmarks.results import add_ratios

    base, new = _row("base", [1, 3, 1]), _row("new", [1, 4, 0.5])
    gone = _row("gone", [], "skipped")
    assert base["throughput_reps"] == [30 / 8] and base["step_time_s"]["median"] == 2
    add_ratios([base, new, gone], ("base",), {"new": "gone"})
    ratio = new["ratios"]["base"]  # step times 2,4,2 against 2,5,1.5
    assert ratio["median"] == pytest.approx(1.0) and ratio["pairs"] == 3
    assert ratio["p10"] == pytest.approx(0.8 + 0.2 * 0.2) and ratio["p90"] < 4 / 3
    cpu = new["cpu_ratios"]["base"]  # CPU 4,12,4 (base) against 4,16,2 (new)
    assert cpu["median"] == pytest.approx(1.0)
    assert base["ratios"] == {} and gone["ratios"] == {}  # no self-ratio, none to a skip


def test_peak_flops_lookup() -> None:
    from benchmarks.results import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", None)[0] == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe", "fp32", None)[0] == pytest.approx(51.2)
    assert peak_tflops("cpu", "fp32", None)[0] is None
    assert peak_tflops("cpu", "fp32", 1.5) == (1.5, "--peak-tflops 1.5")


def test_command_line_checks() -> None:
    from benchmarks.runner import parse_args

    args = parse_args(["--quick", "ddp"])
    assert args.suites == ["ddp"] and args.steps >= 1 and "gpt2-tiny" in args.model
    assert parse_args([]).model == ["gpt2-50m"]
    with pytest.raises(SystemExit):
        parse_args(["nosuchsuite"])
    with pytest.raises(SystemExit):
        parse_args(["--reps", "0"])


def test_one_rank_job_skips_rows_that_need_more(tmp_path: Path) -> None:
    """A row that needs two ranks (split_gather sequence parallelism) is reported skipped at one
    rank, with the reason, while the rest of its suite runs (the 1-rank column of the scaling
    table)."""
    out = tmp_path / "tp1.json"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "tp", "--quick", "--world-size", "1",
         "--rows", "kolossos-tp,kolossos-tp-sp", "--reps", "1", "--steps", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=HANG_S, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["kolossos-tp"]["status"] == "ok" and rows["kolossos-tp"]["throughput"] > 0
    assert rows["kolossos-tp-sp"]["status"] == "skipped"
    assert "at least 2 ranks" in rows["kolossos-tp-sp"]["reason"]
