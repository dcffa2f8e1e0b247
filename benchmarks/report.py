"""Presenting results: a table on stdout, one JSON line per row, a JSON file, and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["format_table", "json_lines", "write_json", "write_plot"]

MiB = 2**20


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


def _ratio(row: dict[str, Any], base: str, key: str = "ratios") -> str:
    r = row.get(key, {}).get(base)
    if r is None:
        return "-"
    return f"{r['median']:.3f} [{r['p10']:.2f},{r['p90']:.2f}]"


def _cells(row: dict[str, Any], refs: list[str]) -> list[str]:
    head = [row["suite"], row["model"], row["name"]]
    if row["status"] != "ok":
        return [*head, f"{row['status']}: {row['reason']}"]
    step = row["step_time_s"]
    mem, comm = row["memory"], row["comm"]
    wire = comm["wire_bytes_per_step_per_rank"][0]
    counterpart = [k for k in row["ratios"] if k not in refs]
    extra = ", ".join(f"vs {k} {_ratio(row, k)}" for k in counterpart)
    mfu = f"{row['model_tflops_per_s']:.3g}"
    if row["mfu"] is not None:
        mfu += f" ({100 * row['mfu']:.1f}%)"
    return [
        *head,
        "ok",
        f"{row['throughput']:.1f} {row['unit']}/s",
        *(_ratio(row, ref) for ref in refs),
        _ratio(row, refs[0], "cpu_ratios") if refs else "-",
        f"{1e3 * step['median']:.1f} ±{100 * step['spread'] / 2:.0f}%",
        f"{_mib(max(mem['model_states_per_rank']))} ({_mib(mem['estimate_model_states'])})",
        f"{_mib(max(mem['peak_per_rank']))} {mem['source']}",
        f"{_mib(comm['bytes_per_step'])}/{_mib(wire)}/{_mib(comm['formula_bytes_per_step'])}",
        mfu,
        extra,
    ]


def format_table(rows: list[dict[str, Any]], references: dict[str, tuple[str, ...]]) -> str:
    """A fixed-width table. Ratio columns are per suite (``references[suite]``): the median and
    [10th, 90th percentile] of the step-paired ratios (``add_ratios``)."""
    out: list[str] = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        refs = list(references.get(suite, ()))
        header = [
            "suite",
            "model",
            "contender",
            "status",
            "throughput",
            *(f"vs {ref}" for ref in refs),
            f"CPU vs {refs[0] if refs else '-'}",
            "step ms (±p10-p90)",
            "states MiB/rank (est)",
            "peak MiB/rank",
            "comm MiB/step log/wire/formula",
            "TFLOP/s (MFU)",
            "other ratios",
        ]
        body = [_cells(r, refs) for r in rows if r["suite"] == suite]
        full = [header, *(c for c in body if c[3] == "ok")]  # status lines spill over
        widths = [max(len(c[i]) for c in full if i < len(c)) for i in range(len(header))]
        line = "  ".join
        out.append(line(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        out.append(line("-" * w for w in widths))
        for cells in body:
            if cells[3] != "ok":  # status line: spill over the remaining columns
                out.append(
                    line([*(c.ljust(w) for c, w in zip(cells[:3], widths, strict=False)), cells[3]])
                )
            else:
                out.append(line(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip())
        out.append("")
    return "\n".join(out)


def json_lines(rows: list[dict[str, Any]]) -> str:
    """One compact JSON object per row and line (prefix-free, so ``jq`` reads stdout's JSON lines
    after ``grep '^{'``)."""
    return "\n".join(json.dumps(row, sort_keys=True, default=str) for row in rows)


def write_json(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``{"meta": {...}, "rows": [...]}`` to ``path`` (parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")


def write_plot(
    path: Path, rows: list[dict[str, Any]], references: dict[str, tuple[str, ...]]
) -> None:
    """Throughput relative to each suite's first reference, and peak memory per rank, as a PNG.

    Raises:
        ImportError: matplotlib is missing (with the install hint).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[bench]')"
        ) from exc
    ok = [r for r in rows if r["status"] == "ok"]
    labels = [f"{r['suite']}/{r['model']}\n{r['name']}" for r in ok]
    relative = []
    for r in ok:
        refs = references.get(r["suite"], ())
        ratio = r["ratios"].get(refs[0]) if refs else None
        relative.append(1.0 if refs and r["name"] == refs[0] else (ratio or {}).get("median", 0))
    peaks = [max(r["memory"]["peak_per_rank"]) / MiB for r in ok]
    states = [max(r["memory"]["model_states_per_rank"]) / MiB for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(ok) + 4), 5))
    ax1.bar(range(len(ok)), relative, color="tab:blue")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_title("throughput / suite's first reference (median of A/B pairs)")
    ax2.bar(range(len(ok)), peaks, color="tab:orange", label="peak")
    ax2.bar(range(len(ok)), states, color="tab:green", label="model states")
    ax2.set_title("memory per rank (MiB)")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(ok)), labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
