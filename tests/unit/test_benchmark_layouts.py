"""``kolossos benchmark`` without processes: the layouts N ranks allow (Colossal-AI's enumeration),
the size rules that skip a layout, option parsing and checking, and the report's arithmetic and
table (CHECKLIST §2.3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kolossos.cli.benchmark import command
from kolossos.cli.benchmark.layouts import (
    Layout,
    Sizes,
    enumerate_layouts,
    integer_root,
    skip_reason,
)
from kolossos.cli.benchmark.options import BenchmarkOptions
from kolossos.cli.benchmark.report import (
    COLUMNS,
    aggregate,
    exit_code,
    format_bytes,
    format_memory,
    format_ms,
    format_table,
    row_cells,
    skipped,
    to_json,
)
from kolossos.cli.main import COMMANDS
from kolossos.cli.main import main as kolossos_main

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- enumeration
@pytest.mark.parametrize(
    ("nproc", "expected"),
    [
        (1, [("data", "dp=1"), ("1d", "1")]),
        (2, [("data", "dp=2"), ("1d", "2")]),
        (4, [("data", "dp=4"), ("1d", "4"), ("2d", "2x2"), ("2.5d-depth1", "2x2x1")]),
        (8, [("data", "dp=8"), ("1d", "8"), ("2.5d-depth2", "2x2x2"), ("3d", "2x2x2")]),
        (9, [("data", "dp=9"), ("1d", "9"), ("2d", "3x3"), ("2.5d-depth1", "3x3x1")]),
        (
            16,
            [
                ("data", "dp=16"),
                ("1d", "16"),
                ("2d", "4x4"),
                ("2.5d-depth1", "4x4x1"),
                ("2.5d-depth4", "2x2x4"),
            ],
        ),
        (27, [("data", "dp=27"), ("1d", "27"), ("2.5d-depth3", "3x3x3"), ("3d", "3x3x3")]),
        (64, ["data", "1d", "2d", "2.5d-depth1", "2.5d-depth4", "2.5d-depth16", "3d"]),
    ],
)
def test_enumeration_follows_colossalai(nproc: int, expected: list[Any]) -> None:
    layouts = enumerate_layouts(nproc)
    if isinstance(expected[0], tuple):
        assert [(layout.name, layout.grid) for layout in layouts] == expected
    else:
        assert [layout.name for layout in layouts] == expected
    assert all(layout.nproc == nproc for layout in layouts)


def test_layout_shapes_and_configs() -> None:
    by_name = {layout.name: layout for layout in enumerate_layouts(8)}
    assert by_name["data"].parallel_config() == {"data": 8}
    assert by_name["1d"].parallel_config() == {"tensor": {"size": 8, "mode": "1d"}}
    assert by_name["2.5d-depth2"].parallel_config() == {
        "tensor": {"size": 8, "mode": "2.5d", "depth": 2}
    }
    assert by_name["3d"].parallel_config() == {"tensor": {"size": 8, "mode": "3d"}}
    assert (by_name["2.5d-depth2"].q, by_name["2.5d-depth2"].depth) == (2, 2)
    assert by_name["3d"].q == 2
    assert [layout.label for layout in by_name.values()] == [
        "data parallel", "1d", "2.5d (depth 2)", "3d"
    ]  # fmt: skip
    for layout in by_name.values():
        assert Layout.from_dict(layout.as_dict()) == layout


def test_bad_layouts_and_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        enumerate_layouts(0)
    with pytest.raises(ValueError, match="mode='4d'"):
        Layout(mode="4d", nproc=4)
    with pytest.raises(ValueError, match="does not hold 8 ranks"):
        Layout(mode="2d", nproc=8, q=2)


def test_integer_root() -> None:
    assert [integer_root(n, 2) for n in (1, 2, 4, 9, 10, 1_000_000)] == [None, None, 2, 3, None,
                                                                        1000]  # fmt: skip
    assert [integer_root(n, 3) for n in (1, 8, 9, 27, 64, 125, 1000)] == [None, 2, None, 3, 4, 5,
                                                                          10]  # fmt: skip


# ---------------------------------------------------------------- size rules
@pytest.mark.parametrize(
    ("layout", "batch", "dim", "needle"),
    [
        (Layout(mode=None, nproc=4), 6, 16, "--batch_size 6 is not a multiple of 4"),
        (Layout(mode="1d", nproc=4), 8, 18, "--dimension 18 is not a multiple of 4"),
        (Layout(mode="2d", nproc=4, q=2), 3, 16, "--batch_size 3 is not a multiple of 2"),
        (Layout(mode="2d", nproc=4, q=2), 8, 6, "--dimension 6 is not a multiple of 4"),
        (Layout(mode="2.5d", nproc=8, q=2, depth=2), 6, 16, "multiple of 4 (2.5D splits the batch"),
        (Layout(mode="2.5d", nproc=8, q=2, depth=2), 8, 5, "--dimension 5 is not a multiple of 2"),
        (Layout(mode="3d", nproc=8, q=2), 6, 16, "--batch_size 6 is not a multiple of 4"),
        (Layout(mode="3d", nproc=8, q=2), 8, 6, "--dimension 6 is not a multiple of 4"),
    ],
)
def test_sizes_that_do_not_fit_name_the_flag_and_rule(
    layout: Layout, batch: int, dim: int, needle: str
) -> None:
    reason = skip_reason(layout, Sizes(batch_size=batch, dimension=dim))
    assert reason is not None and needle in reason


def test_fitting_sizes_have_no_reason() -> None:
    for nproc in (1, 2, 4, 8, 9, 16):
        for layout in enumerate_layouts(nproc):
            assert skip_reason(layout, Sizes(batch_size=144, dimension=144)) is None, layout
    # 2.5D splits the hidden size by q only (the bias too): 6 fits q = 2
    assert skip_reason(Layout(mode="2.5d", nproc=4, q=2), Sizes(batch_size=8, dimension=6)) is None


# ---------------------------------------------------------------- options
def test_defaults_are_colossalai_s() -> None:
    options, path = command.parse_options(["--nproc", "4"])
    assert path is None
    assert (options.batch_size, options.seq_len, options.dimension) == (8, 512, 1024)
    assert (options.warmup_steps, options.profile_steps, options.layers) == (10, 50, 2)
    assert options.model == "mlp"


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--gpus",
            "4",
            "--batch_size",
            "16",
            "--seq_len",
            "3",
            "--dimension",
            "32",
            "--warmup_steps",
            "0",
            "--profile_steps",
            "2",
            "--layers",
            "3",
            "--model",
            "MLP",
        ],
        [
            "-g",
            "4",
            "-b",
            "16",
            "-s",
            "3",
            "-d",
            "32",
            "-w",
            "0",
            "-p",
            "2",
            "-l",
            "3",
            "-m",
            "mlp",
        ],
        [
            "--nproc",
            "4",
            "--batch-size",
            "16",
            "--seq-len",
            "3",
            "--dimension",
            "32",
            "--warmup-steps",
            "0",
            "--profile-steps",
            "2",
            "--layers",
            "3",
        ],
    ],
    ids=["colossalai-long", "colossalai-short", "hyphens"],
)
def test_every_spelling_of_the_flags(argv: list[str]) -> None:
    options, _ = command.parse_options(argv)
    assert options == BenchmarkOptions(nproc=4, batch_size=16, seq_len=3, dimension=32,
                                       warmup_steps=0, profile_steps=2, layers=3)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        ([], ["--nproc is required"]),
        (["--nproc", "0"], ["--nproc 0", ">= 1"]),
        (["--nproc", "-2"], ["--nproc -2", ">= 1"]),
        (["--nproc", "4", "--batch_size", "0"], ["--batch_size 0", ">= 1"]),
        (["--nproc", "4", "--dimension", "0"], ["--dimension 0"]),
        (["--nproc", "4", "--warmup_steps", "-1"], ["--warmup_steps -1", ">= 0"]),
        (["--nproc", "4", "--profile_steps", "0"], ["--profile_steps 0", "timed"]),
        (["--nproc", "4", "--layers", "0"], ["--layers 0"]),
        (["--nproc", "4", "--model", "gpt"], ["--model 'gpt'", "mlp"]),
        (["--nproc", "4", "--layer", "2"], ["unknown option --layer", "--layers"]),
        (["--nproc", "four"], ["invalid int value"]),
        (["--nproc", "4", "--json", "/no/such/folder/x.json"], ["does not exist"]),
        (
            ["--nproc", "4", "--batch_size", "3", "--dimension", "6"],
            ["no layout fits", "2d: --batch_size 3"],
        ),
        (["--nproc", "100000"], ["--nproc 100000", "more processes than this machine"]),
    ],
)
def test_bad_input_exits_2_with_a_message_and_starts_nothing(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    def no_job(*_: Any) -> None:
        raise AssertionError("a job was started")

    monkeypatch.setattr(command, "_run_job", no_job)
    assert kolossos_main(["benchmark", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kolossos benchmark: error: ")
    for needle in needles:
        assert needle in err


def test_help_and_registration(capsys: pytest.CaptureFixture[str]) -> None:
    assert COMMANDS["benchmark"][0] == "kolossos.cli.benchmark"
    assert kolossos_main(["--help"]) == 0
    assert "benchmark" in capsys.readouterr().out
    assert kolossos_main(["benchmark", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--gpus", "--nproc", "--batch_size", "--seq_len", "--dimension",
                 "--warmup_steps", "--profile_steps", "--layers", "--model", "--json"):  # fmt: skip
        assert flag in text


def test_command_line_starts_without_torch() -> None:
    code = "import sys, kolossos.cli.benchmark; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---------------------------------------------------------------- report
LAYOUT = Layout(mode="2d", nproc=2 * 2, q=2).as_dict()


def _rank(forward: list[float], backward: list[float], peak: int = 100, comm: int = 64,
          error: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {"forward_s": forward, "backward_s": backward, "peak_bytes": peak,
            "memory_source": "tracker", "comm_bytes": comm, "comm_sent_bytes": comm / 2,
            "comm_calls": 3, "error": error}  # fmt: skip


def test_aggregate_takes_the_slowest_rank_per_step_and_the_largest_rank() -> None:
    ranks = [
        _rank([0.001, 0.003], [0.002, 0.001], peak=100),
        _rank([0.002, 0.001], [0.002, 0.001], peak=300, comm=80),
        _rank([0.001, 0.001], [0.001, 0.001]),
        _rank([0.001, 0.001], [0.001, 0.001]),
    ]
    result = aggregate(LAYOUT, ranks)
    assert result.status == "ok"
    assert result.step_ms is not None
    assert result.step_ms["mean"] == pytest.approx(4.0)  # steps: max(3, 4) = 4 ms, max(4, 2) = 4
    assert result.step_ms["std"] == pytest.approx(0.0)
    assert result.forward_ms == pytest.approx(2.5)  # max per step: 2 ms, 3 ms
    assert result.backward_ms == pytest.approx(1.5)
    assert result.peak_memory_bytes == 300
    assert result.comm_bytes_per_step == 80
    assert result.per_rank["comm_bytes"] == [64, 80, 64, 64]


def test_a_failed_layout_names_its_ranks_and_fails_the_command() -> None:
    every = aggregate(LAYOUT, [_rank([], [], error="ValueError: bad")] * 4)
    assert every.status == "failed" and every.reason == "every rank: ValueError: bad"
    one = aggregate(LAYOUT, [_rank([0.1], [0.1])] * 3 + [_rank([], [], error="KeyError: x")])
    assert one.status == "failed" and one.reason == "rank 3: KeyError: x"
    short = aggregate(LAYOUT, [_rank([0.1], [0.1])] * 3)
    assert short.status == "failed" and short.reason == "3 of 4 ranks reported"
    assert exit_code([every]) == 1
    cells = row_cells(every)
    assert cells[-1] == "FAILED: every rank: ValueError: bad" and cells[2:7] == ["-"] * 5
    skip = skipped(Layout(mode="1d", nproc=4), "--dimension 6 is not a multiple of 4 (...)")
    assert exit_code([skip]) == 0
    assert row_cells(skip)[-1].startswith("skipped: --dimension 6")


def test_missing_layouts_are_failures() -> None:
    layouts = enumerate_layouts(4)
    measured = {"results": [{"layout": layouts[0].as_dict(),
                             "ranks": [_rank([0.1], [0.1])] * 4}]}  # fmt: skip
    results = command._results(layouts, {"1d": "why"}, measured)
    assert [r.status for r in results] == ["ok", "skipped", "failed", "failed"]
    assert "ended before" in (results[2].reason or "")
    assert exit_code(results) == 1


def test_formats_and_table() -> None:
    assert format_ms(1.23456, 0.5) == "1.235 ± 0.500"
    assert format_ms(2.0) == "2.000"
    assert format_bytes(1048576) == "1,048,576"
    assert [format_memory(n) for n in (512, 1536, 16 * 2**20)] == ["512 B", "1.5 KiB", "16.0 MiB"]
    options = BenchmarkOptions(nproc=4, batch_size=8, seq_len=2, dimension=16, layers=1)
    results = [aggregate(LAYOUT, [_rank([0.001], [0.002])] * 4)]
    environment = {"backend": "gloo", "device": "cpu", "device_name": "cpu"}
    table = format_table(results, options, environment)
    lines = table.splitlines()
    assert "4 processes on cpu (gloo)" in lines[0]
    assert lines[2].split("  ")[0] == COLUMNS[0]
    assert lines[3].split() == ["2d", "2x2", "3.000", "±", "0.000", "1.000", "2.000", "100", "B",
                                "64", "ok"]  # fmt: skip
    payload = to_json(results, options, environment)
    assert payload["layouts"][0]["comm_bytes_per_step"] == 64
    assert payload["options"]["dimension"] == 16
