"""Turn every rank's figures into one result per layout, and print them as a table or JSON.

Per layout: the step time (forward + backward of the slowest rank in each profiled step) as
mean, standard deviation, minimum and maximum; the mean forward and backward times; the peak
memory and the bytes communicated per step, both the largest over the ranks (every rank's value
is kept in the JSON). Pure functions of the worker's results: no torch, no process group.

Example:
    >>> result = skipped(Layout(mode="2d", nproc=4, q=2), "--dimension 18 is not ...")
    >>> result.status, exit_code([result])
    ('skipped', 0)
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from kolossos.cli.benchmark.layouts import Layout
from kolossos.cli.benchmark.options import BenchmarkOptions

__all__ = [
    "COLUMNS",
    "LayoutResult",
    "aggregate",
    "exit_code",
    "format_bytes",
    "format_memory",
    "format_ms",
    "format_table",
    "missing",
    "row_cells",
    "skipped",
    "to_json",
]

#: the table's columns, in order
COLUMNS = ("layout", "grid", "step ms (mean ± std)", "forward ms", "backward ms", "peak memory",
           "comm bytes/step", "status")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class LayoutResult:
    """The outcome of one layout."""

    layout: dict[str, Any]
    """:meth:`Layout.as_dict`."""
    status: str
    """``ok``, ``skipped`` (the sizes do not fit it) or ``failed``."""
    reason: str | None = None
    """Why it was skipped, or the error (``rank R: Type: message``)."""
    step_ms: dict[str, float] | None = None
    """``mean``, ``std``, ``min``, ``max`` of the step time (slowest rank per step)."""
    forward_ms: float | None = None
    """Mean forward time (slowest rank per step)."""
    backward_ms: float | None = None
    """Mean backward time (slowest rank per step)."""
    peak_memory_bytes: int | None = None
    """Peak memory of a step, the largest over the ranks."""
    memory_source: str | None = None
    """``allocator`` (GPU: max allocated) or ``tracker`` (CPU: every tensor storage)."""
    comm_bytes_per_step: int | None = None
    """Logical bytes of the collectives of one step, the largest over the ranks."""
    comm_sent_bytes_per_step: float | None = None
    """Modelled bytes put on the wire in one step, the largest over the ranks."""
    comm_calls_per_step: int | None = None
    """Collective calls of one step, the largest over the ranks."""
    per_rank: dict[str, list[Any]] = field(default_factory=dict)
    """``peak_memory_bytes``, ``comm_bytes``, ``comm_sent_bytes`` of every rank."""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)


def skipped(layout: Layout, reason: str) -> LayoutResult:
    """The result of a layout the sizes do not fit (it was not run)."""
    return LayoutResult(layout=layout.as_dict(), status="skipped", reason=reason)


def missing(layout: Layout, reason: str) -> LayoutResult:
    """The result of a layout the job did not report (it ended before reaching it)."""
    return LayoutResult(layout=layout.as_dict(), status="failed", reason=reason)


def _errors(ranks: list[dict[str, Any]]) -> str | None:
    messages: dict[str, list[int]] = {}
    for rank, figures in enumerate(ranks):
        if figures.get("error"):
            messages.setdefault(figures["error"], []).append(rank)
    if not messages:
        return None
    parts = []
    for message, where in messages.items():
        who = "every rank" if len(where) == len(ranks) > 1 else "rank " + ",".join(map(str, where))
        parts.append(f"{who}: {message}")
    return "; ".join(parts)


def aggregate(layout: dict[str, Any], ranks: list[dict[str, Any]]) -> LayoutResult:
    """One layout's result from every rank's :class:`~kolossos.cli.benchmark.measure.
    RankMeasurement` (as dicts, in rank order)."""
    error = _errors(ranks)
    if error is None and len(ranks) != layout["nproc"]:
        error = f"{len(ranks)} of {layout['nproc']} ranks reported"
    if error is not None:
        return LayoutResult(layout=layout, status="failed", reason=error)
    forward = [max(r["forward_s"][i] for r in ranks) for i in range(len(ranks[0]["forward_s"]))]
    backward = [max(r["backward_s"][i] for r in ranks) for i in range(len(forward))]
    steps = [
        max(r["forward_s"][i] + r["backward_s"][i] for r in ranks) * 1e3
        for i in range(len(forward))
    ]
    spread = statistics.pstdev(steps) if len(steps) > 1 else 0.0
    return LayoutResult(
        layout=layout,
        status="ok",
        step_ms={
            "mean": statistics.fmean(steps),
            "std": spread,
            "min": min(steps),
            "max": max(steps),
        },
        forward_ms=statistics.fmean(forward) * 1e3,
        backward_ms=statistics.fmean(backward) * 1e3,
        peak_memory_bytes=max(r["peak_bytes"] for r in ranks),
        memory_source=ranks[0]["memory_source"],
        comm_bytes_per_step=max(r["comm_bytes"] for r in ranks),
        comm_sent_bytes_per_step=max(r["comm_sent_bytes"] for r in ranks),
        comm_calls_per_step=max(r["comm_calls"] for r in ranks),
        per_rank={
            "peak_memory_bytes": [r["peak_bytes"] for r in ranks],
            "comm_bytes": [r["comm_bytes"] for r in ranks],
            "comm_sent_bytes": [r["comm_sent_bytes"] for r in ranks],
        },
    )


def format_ms(mean: float, std: float | None = None) -> str:
    """``1.234`` or ``1.234 ± 0.056`` (milliseconds, three decimals)."""
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def format_bytes(value: int) -> str:
    """An exact byte count with thousands separators: ``1,048,576``."""
    return f"{value:,}"


def format_memory(value: int) -> str:
    """A byte count in binary units with one decimal: ``512 B``, ``1.5 KiB``, ``16.0 MiB``."""
    if value < 1024:
        return f"{value} B"
    size = float(value)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def row_cells(result: LayoutResult) -> list[str]:
    """The table cells of one result, in :data:`COLUMNS` order."""
    head = [result.layout["label"], result.layout["grid"]]
    if result.status != "ok":
        word = "skipped" if result.status == "skipped" else "FAILED"
        return [*head, "-", "-", "-", "-", "-", f"{word}: {result.reason}"]
    assert result.step_ms is not None and result.forward_ms is not None
    assert result.backward_ms is not None and result.peak_memory_bytes is not None
    assert result.comm_bytes_per_step is not None
    return [
        *head,
        format_ms(result.step_ms["mean"], result.step_ms["std"]),
        format_ms(result.forward_ms),
        format_ms(result.backward_ms),
        format_memory(result.peak_memory_bytes),
        format_bytes(result.comm_bytes_per_step),
        "ok",
    ]


def _header(options: BenchmarkOptions, environment: dict[str, Any]) -> str:
    d = options.dimension
    device = environment.get("device_name") or environment.get("device", "?")
    return (
        f"kolossos benchmark: MLP of {options.layers} x Linear({d}, {d}), input "
        f"(batch_size {options.batch_size}, seq_len {options.seq_len}, dimension {d}); "
        f"{options.nproc} processes on {device} ({environment.get('backend', '?')}); "
        f"{options.warmup_steps} warm-up + {options.profile_steps} profiled steps"
    )


_NOTE = (
    "step: forward + backward of the slowest rank. peak memory and comm bytes/step (logical\n"
    "bytes of the collectives in one step): the largest rank's; memory is {source}."
)


def format_table(
    results: list[LayoutResult], options: BenchmarkOptions, environment: dict[str, Any]
) -> str:
    """The report: a header line, the table (one row per layout), and what the columns mean."""
    rows = [list(COLUMNS), *(row_cells(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    source = "the allocator's max allocated" if environment.get("device") not in (None, "cpu") \
        else "every tensor storage's (CPU)"  # fmt: skip
    return "\n".join([_header(options, environment), "", *lines, "", _NOTE.format(source=source)])


def to_json(
    results: list[LayoutResult], options: BenchmarkOptions, environment: dict[str, Any]
) -> dict[str, Any]:
    """The report as one JSON-ready object (``--json``)."""
    return {
        "command": "kolossos benchmark",
        "options": options.as_dict(),
        "environment": dict(environment),
        "layouts": [r.as_dict() for r in results],
    }


def exit_code(results: list[LayoutResult]) -> int:
    """0 when no layout failed (skipped ones do not count), else 1."""
    return 1 if any(r.status == "failed" for r in results) else 0
