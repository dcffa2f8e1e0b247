"""``python -m benchmarks summary`` tables and ``profile``'s operator categories."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ sits beside the package, not installed with it
    sys.path.insert(0, str(ROOT))

from benchmarks.profile_steps import classify  # noqa: E402
from benchmarks.summary import main, ratio_table, scaling_table  # noqa: E402


def _row(name: str, world: int, tput: list[float], cpu: list[float], peak: int) -> dict[str, Any]:
    return {
        "suite": "deepspeed", "model": "gpt2-tiny", "name": name, "status": "ok",
        "world_size": world, "throughput": sum(tput) / len(tput),
        "slots": {"throughput": tput, "cpu_per_unit": cpu},
        "memory": {"peak_per_rank": [peak, peak - 1]}, "_file": f"r{world}.json",
    }  # fmt: skip


def test_ratio_and_scaling_tables(tmp_path: Path) -> None:
    rows = [
        _row("kolossos-zero2", 2, [12.0, 10.0, 11.0], [1.0, 1.0, 1.0], 3 * 2**20),
        _row("deepspeed-zero2", 2, [10.0, 10.0, 10.0], [1.2, 1.1, 1.3], 4 * 2**20),
    ]
    table = ratio_table(rows)
    assert "| r2 | 2 | gpt2-tiny | kolossos-zero2 | deepspeed-zero2 | 1.10 [1.02, 1.18] |" in table
    assert "1.20 [1.12, 1.28] | - | 3 (4) |" in table  # no floor row in the job: no ceiling
    floor = _row("floor", 2, [15.0, 15.0, 15.0], [0.8, 0.8, 0.8], 2**20)
    ceiling = ratio_table([*rows, floor])  # deepspeed-zero2's CPU over the floor's, per step
    assert "| 1.20 [1.12, 1.28] | 1.50 [1.40, 1.60] | 3 (4) |" in ceiling
    assert "| floor |" not in ceiling  # the floor is a bound, not a row to compare
    assert scaling_table(rows) == ""  # one world size only
    more = [*rows, _row("kolossos-zero2", 4, [22.0], [1.0], 2**20)]
    assert "| deepspeed | gpt2-tiny | kolossos-zero2 | 11 (1.00×) | 22 (2.00×) |" in scaling_table(
        more
    )
    # the same row name in another suite is a line of its own, not merged across suites
    other = [{**r, "suite": "zero", "throughput": 2 * r["throughput"]} for r in more[::2]]
    both = scaling_table([*more, *other])
    assert "| zero | gpt2-tiny | kolossos-zero2 | 22 (1.00×) | 44 (2.00×) |" in both
    assert "| deepspeed | gpt2-tiny | kolossos-zero2 | 11 (1.00×) | 22 (2.00×) |" in both
    for world in (2, 4):
        keep = [r for r in more if r["world_size"] == world]
        data = {"meta": {"loadavg_after": [1.0]}, "rows": keep}
        (tmp_path / f"r{world}.json").write_text(json.dumps(data))
    out = tmp_path / "summary.md"
    argv = [str(tmp_path / "r2.json"), "--scaling", str(tmp_path / "r2.json"),
            str(tmp_path / "r4.json"), "--markdown", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "### Scaling" in out.read_text()


def test_run_label_names_the_suite_when_a_file_holds_several() -> None:
    rows = []
    for suite in ("deepspeed", "fsdp"):
        for name, cpu in (("kolossos-gemini", 1.0), ("fsdp2", 1.2)):
            row = _row(name, 2, [10.0, 10.0], [cpu, cpu], 2**20)
            rows.append({**row, "suite": suite, "_file": "both.json"})
    table = ratio_table(rows)
    assert "| both (deepspeed) | 2 | gpt2-tiny | kolossos-gemini | fsdp2 |" in table
    assert "| both (fsdp) | 2 | gpt2-tiny | kolossos-gemini | fsdp2 |" in table
    assert "| both | " not in table


def test_operator_categories() -> None:
    assert classify("Optimizer.step#Adam.step") == "optim"
    assert classify("c10d::allreduce_") == "comm"
    assert classify("comm::wait") == "comm"
    assert classify("aten::copy_") == "copy"
    assert classify("aten::mm") is None


def test_markdown_between_markers(tmp_path: Path) -> None:
    from benchmarks.summary import BEGIN, END, write_markdown

    page = tmp_path / "page.md"
    page.write_text(f"intro\n{BEGIN}\nold\n{END}\noutro\n")
    write_markdown(page, "new\n")
    assert page.read_text() == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"
