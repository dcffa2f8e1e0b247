"""The performance summary of ``docs/benchmarks.md``: ``python -m benchmarks summary``.

Reads result files of the runner (``--out`` JSON, one per world size) and writes

* a **ratio table**: every kolossos row against the baselines it must beat (ZeRO-1/2 against
  the same DeepSpeed stage, Gemini against DeepSpeed ZeRO-3 and FSDP2, the DDP and FSDP plugins
  against torch's), as the step-paired throughput ratio (median [p10, p90]), the step-paired CPU
  cost ratio (> 1: kolossos costs less CPU per token), the CPU cost ratio's *ceiling* when the
  job ran the ``floor`` row (the baseline's CPU per token over the floor's: no row that runs the
  model's forward and backward can cost less than the floor, so no CPU cost ratio against that
  baseline can exceed it) and the peak memory per rank of both;
* a **scaling table** from the ``--scaling`` files (one model at several world sizes, any
  suites): every row's throughput at each world size and its speed-up over the smallest one;
* a PNG with both (``--plot``, needs matplotlib: ``.venv-bench`` has it).

``--run`` first produces the files: the ``deepspeed`` suite (kolossos ZeRO-1/2 and Gemini,
DeepSpeed ZeRO-1/2/3, torch DDP, FSDP2) at every ``--world-sizes`` entry, with the runner's
usual step-paired A/B timing.

Examples::

    python -m benchmarks summary runs/benchmarks/a.json --scaling runs/benchmarks/s1.json \\
        runs/benchmarks/s2.json --markdown docs/benchmarks_summary.md --plot summary.png
    python -m benchmarks summary --run --model gpt2-30m --world-sizes 1 2 4 --reps 2 --steps 3 \\
        --markdown docs/benchmarks_summary.md --plot docs/benchmarks_summary.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.results import _paired

__all__ = ["BASELINES", "main", "ratio_table", "scaling_table", "write_markdown"]

MiB = 2**20

#: kolossos row -> the baselines it is compared to
BASELINES: dict[str, tuple[str, ...]] = {
    "kolossos-zero1": ("deepspeed-zero1",),
    "kolossos-zero2": ("deepspeed-zero2",),
    "kolossos-gemini": ("deepspeed-zero3", "fsdp2"),
    "kolossos-ddp": ("torch-ddp",),
    "kolossos-fsdp": ("fsdp2",),
}


def _load(paths: list[Path]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if row.get("status") == "ok":
                rows.append({**row, "_file": path.name})
    return rows


def _run_label(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(file, suite) -> the ``run`` label: the file's stem, with the suite in parentheses when
    the file holds several suites (``deepspeed fsdp`` jobs both have a ``fsdp2`` row)."""
    suites: dict[str, set[str]] = {}
    for row in rows:
        suites.setdefault(row["_file"], set()).add(row["suite"])
    return {
        (file, suite): Path(file).stem if len(names) == 1 else f"{Path(file).stem} ({suite})"
        for file, names in suites.items()
        for suite in names
    }


def _peak(row: dict[str, Any]) -> float:
    return float(max(row["memory"]["peak_per_rank"])) / MiB


def _fmt(r: dict[str, float]) -> str:
    return f"{r['median']:.2f} [{r['p10']:.2f}, {r['p90']:.2f}]"


def ratio_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each kolossos row against its baselines, per job (file, suite, model)."""
    lines = [
        "| run | ranks | model | row | vs | throughput ratio | CPU cost ratio | ceiling "
        "| peak MiB/rank (baseline) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    jobs: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        jobs.setdefault((row["_file"], row["suite"], row["model"]), {})[row["name"]] = row
    labels = _run_label(rows)
    for (file, suite, model), by_name in jobs.items():
        floor = by_name.get("floor")
        for name, bases in BASELINES.items():
            mine = by_name.get(name)
            if mine is None:
                continue
            row = mine
            steps = len(row["slots"]["throughput"])
            for base in bases:
                ref = by_name.get(base)
                if ref is None or len(ref["slots"]["throughput"]) != steps:
                    continue
                speed = _paired(row["slots"]["throughput"], ref["slots"]["throughput"])
                cost = _paired(ref["slots"]["cpu_per_unit"], row["slots"]["cpu_per_unit"])
                ceiling = "-"
                if floor is not None and len(floor["slots"]["cpu_per_unit"]) == steps:
                    ceiling = _fmt(
                        _paired(ref["slots"]["cpu_per_unit"], floor["slots"]["cpu_per_unit"])
                    )
                lines.append(
                    f"| {labels[file, suite]} | {row['world_size']} | {model} | {name} | {base} | "
                    f"{_fmt(speed)} | {_fmt(cost)} | {ceiling} | "
                    f"{_peak(row):.0f} ({_peak(ref):.0f}) |"
                )
    return "\n".join(lines)


def _scaling(
    rows: list[dict[str, Any]],
) -> dict[tuple[str, str, str], dict[int, dict[str, Any]]]:
    """(suite, model, row) -> world size -> row, for the rows measured at two sizes or more
    (a baseline such as ``fsdp2`` sits in several suites: each suite's is its own line)."""
    table: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for row in rows:
        key = (row["suite"], row["model"], row["name"])
        table.setdefault(key, {})[int(row["world_size"])] = row
    return {key: sizes for key, sizes in table.items() if len(sizes) > 1}


def scaling_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: throughput per world size and the speed-up over the smallest (empty when
    the files hold one world size)."""
    table = _scaling(rows)
    sizes = sorted({n for per in table.values() for n in per})
    if not table:
        return ""
    head = " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in sizes)
    lines = [f"| suite | model | row | {head} |", "|---|---|---|" + "---|" * len(sizes)]
    for (suite, model, name), per in table.items():
        first = per[min(per)]["throughput"]
        cells = []
        for n in sizes:
            row = per.get(n)
            if row is None:
                cells.append("-")
                continue
            cells.append(f"{row['throughput']:.0f} ({row['throughput'] / first:.2f}×)")
        lines.append(f"| {suite} | {model} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(path: Path, rows: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> None:
    """Ratios of the kolossos rows (left) and throughput against world size (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5))
    labels, values, errors = [], [], []
    jobs: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for entry in rows:
        jobs.setdefault((entry["_file"], entry["suite"], entry["model"]), {})[entry["name"]] = entry
    run_labels = _run_label(rows)
    for (file, suite, _), by_name in jobs.items():
        for name, bases in BASELINES.items():
            for base in bases:
                row, ref = by_name.get(name), by_name.get(base)
                if row is None or ref is None:
                    continue
                r = _paired(row["slots"]["throughput"], ref["slots"]["throughput"])
                labels.append(f"{name.removeprefix('kolossos-')}/{base}\n{run_labels[file, suite]}")
                values.append(r["median"])
                errors.append((r["median"] - r["p10"], r["p90"] - r["median"]))
    ax1.bar(range(len(values)), values, yerr=list(zip(*errors, strict=True)) if errors else None,
            color="tab:blue", capsize=3)  # fmt: skip
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.axhline(1.2, color="tab:red", lw=0.8, ls="--")
    ax1.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
    ax1.set_title("kolossos / baseline throughput (step-paired median, p10-p90)")
    ticks: set[int] = set()
    ax2.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
    for (suite, model, name), per in _scaling(scaling).items():
        if per[min(per)].get("role") != "kolossos":
            continue  # the baselines are in the table; the plot keeps kolossos' rows legible
        sizes = sorted(per)
        ticks.update(sizes)
        ax2.plot(sizes, [per[n]["throughput"] for n in sizes], marker="o",
                 label=f"{suite}/{name.removeprefix('kolossos-')} ({model})")  # fmt: skip
    ax2.set_xticks(sorted(ticks))
    ax2.set_xlabel("ranks")
    ax2.set_ylabel("tokens/s (all ranks)")
    ax2.set_title("scaling of the kolossos rows (baselines: the table)")
    if ax2.lines:
        ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


BEGIN, END = "<!-- benchmarks summary: begin -->", "<!-- benchmarks summary: end -->"


def write_markdown(path: Path, text: str) -> None:
    """Write ``text`` to ``path``; into an existing file holding the :data:`BEGIN` and
    :data:`END` markers, replace only what lies between them (a section of a larger page)."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        text = f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _run(args: argparse.Namespace) -> list[Path]:
    from benchmarks.runner import main as run_suite

    out: list[Path] = []
    for n in args.world_sizes:
        path = args.results_dir / f"summary-{args.model}-{n}r.json"
        argv = ["deepspeed", "--model", args.model, "--world-size", str(n), "--reps",
                str(args.reps), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--interleave", args.interleave, "--out", str(path)]  # fmt: skip
        if args.rows:
            argv += ["--rows", args.rows]
        status = run_suite(argv)
        if status != 0:
            print(f"[summary] world size {n}: the run exited {status}", file=sys.stderr)
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line (module doc)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks summary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("results", nargs="*", type=Path, help="runner JSON files (ratio table)")
    p.add_argument(
        "--scaling",
        nargs="+",
        type=Path,
        default=[],
        help="runner JSON files of one model at several world sizes (scaling table)",
    )
    p.add_argument("--run", action="store_true", help="run the deepspeed suite first")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--model", default="gpt2-30m")
    p.add_argument("--rows", help="only these rows (comma-separated)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--interleave", default="step", choices=("step", "rep"))
    p.add_argument("--results-dir", type=Path, default=Path("runs/benchmarks"))
    p.add_argument(
        "--markdown",
        type=Path,
        help="write the tables here, between the summary markers if the file has them",
    )
    p.add_argument("--plot", type=Path, help="write the PNG here")
    args = p.parse_args(argv)
    paths, scaling_paths = list(args.results), list(args.scaling)
    if args.run:
        produced = _run(args)
        paths += produced
        scaling_paths += produced
    if not paths and not scaling_paths:
        p.error("give result files or --run")
    missing = [str(path) for path in [*paths, *scaling_paths] if not path.exists()]
    if missing:
        p.error(f"result files not found: {missing}")
    rows = _load(paths)
    text = "#### Ratios\n\n" + ratio_table(rows) + "\n"
    scaling = scaling_table(_load(scaling_paths))
    if scaling:
        text += "\n#### Scaling (tokens/s, all ranks; speed-up over the fewest ranks)\n\n"
        text += scaling + "\n"
    loads = []
    for path in dict.fromkeys([*paths, *scaling_paths]):
        meta = json.loads(path.read_text()).get("meta", {})
        if meta.get("loadavg_after") is not None:
            load = ", ".join(f"{x:.1f}" for x in meta["loadavg_after"])
            loads.append(f"{path.stem}: load average {load}")
    if loads:
        text += "\n" + "; ".join(loads) + "\n"
    print(text)
    if args.markdown is not None:
        write_markdown(args.markdown, text)
    if args.plot is not None:
        write_plot(args.plot, rows, _load(scaling_paths))
    return 0
