"""Schedule simulator: run a :class:`ScheduleTable` on modelled action costs, print its timeline
(text Gantt chart, or a PNG with ``--plot``) and its bubble fraction.

Each rank executes its actions in table order, each as soon as its inputs exist (the previous
stage's forward, the next stage's backward; plus a fixed communication latency between ranks).
A table whose orders wait on each other in a cycle cannot finish: :func:`simulate` raises
:class:`DeadlockError` naming the stuck actions, which is how the tests prove a schedule
deadlock-free.

    python -m kolossos.pipeline.simulate --schedule 1f1b --pp 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kolossos.pipeline.schedule.registry import SCHEDULES, build_table, schedule_names
from kolossos.pipeline.schedule.simulation import Costs, DeadlockError, Timeline, simulate
from kolossos.pipeline.schedule.table import ActionKind

__all__ = [
    "Costs",
    "DeadlockError",
    "Timeline",
    "closed_form_bubble",
    "format_gantt",
    "main",
    "simulate",
]


def closed_form_bubble(
    name: str, pp_size: int, num_microbatches: int, num_chunks: int = 1
) -> float | None:
    """The textbook bubble fraction of registered schedule ``name`` with ``F = 1``, ``B = 2``
    (or ``B = W = 1``) and free communication (its
    :class:`~kolossos.pipeline.schedule.registry.ScheduleSpec`'s ``closed_form``), or
    ``None`` when there is no simple formula (or no such schedule).

    GPipe and 1F1B: ``(p-1)/(m+p-1)``; interleaved with ``v`` chunks: ``(p-1)/(v m+p-1)``;
    ZB-H1 (the deferred ``W`` parts fill two thirds of 1F1B's bubble): ``(p-1)/(3m+p-1)``;
    ZB-V (only the start-up wait of ``r`` units on rank ``r`` is left): ``(p-1)/(6m+p-1)``. The
    zero-bubble forms hold for ``m >= p``; with fewer micro-batches the bubble is larger.
    """
    spec = SCHEDULES.get(name)
    if spec is None or spec.closed_form is None:
        return None
    return spec.closed_form(pp_size, num_microbatches, num_chunks)


def format_gantt(timeline: Timeline, width: int = 100) -> str:
    """A text Gantt chart: one row per rank, one column per time unit (scaled to ``width``
    columns when longer); each cell shows the action kind (``F``/``B``/``W``), lower case for
    chunks > 0, ``.`` when idle."""
    span = timeline.makespan
    if span <= 0:
        return ""
    scale = min(1.0, width / span)
    cols = max(1, round(span * scale))
    rows = []
    for rank, actions in enumerate(timeline.table.ranks):
        cells = ["."] * cols
        for action, (start, end) in zip(actions, timeline.spans[rank], strict=True):
            mark = action.kind.value if action.chunk == 0 else action.kind.value.lower()
            lo, hi = round(start * scale), max(round(start * scale) + 1, round(end * scale))
            for c in range(lo, min(hi, cols)):
                cells[c] = mark
        rows.append(f"rank {rank:>2} |{''.join(cells)}|")
    return "\n".join(rows)


def write_png(timeline: Timeline, path: Path) -> None:
    """Draw the timeline with matplotlib (imported here: optional dependency).

    Raises:
        ImportError: matplotlib is missing (with the install hint).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from exc
    colours = {ActionKind.F: "tab:blue", ActionKind.B: "tab:orange", ActionKind.W: "tab:green"}
    table = timeline.table
    fig, ax = plt.subplots(figsize=(max(6.0, timeline.makespan / 3), 0.6 * table.pp_size + 1))
    for rank, actions in enumerate(table.ranks):
        for action, (start, end) in zip(actions, timeline.spans[rank], strict=True):
            alpha = 1.0 if action.chunk == 0 else 0.55
            ax.barh(rank, end - start, left=start, color=colours[action.kind], alpha=alpha,
                    edgecolor="black", linewidth=0.4)  # fmt: skip
            ax.text((start + end) / 2, rank, str(action), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(table.pp_size), [f"rank {r}" for r in range(table.pp_size)])
    ax.invert_yaxis()
    ax.set_xlabel("time (modelled units)")
    ax.set_title(f"{table.name}: bubble {100 * timeline.bubble_fraction:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kolossos.pipeline.simulate", description=__doc__)
    p.add_argument("--schedule", choices=schedule_names(), default="1f1b")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--chunks", type=int, help="model chunks per rank (interleaved; zbv: 2)")
    p.add_argument("--forward", type=float, default=1.0, help="cost of F")
    p.add_argument("--backward", type=float, default=2.0, help="cost of an unsplit B")
    p.add_argument("--input-grad", type=float, default=1.0, help="cost of a split B")
    p.add_argument("--weight-grad", type=float, default=1.0, help="cost of W")
    p.add_argument("--comm", type=float, default=0.0, help="latency between ranks")
    p.add_argument("--width", type=int, default=100, help="columns of the text chart")
    p.add_argument("--plot", type=Path, nargs="?", const=Path("schedule.png"),
                   help="also draw a PNG (default schedule.png; needs matplotlib)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    args = _parse(argv)
    table = build_table(args.schedule, args.pp, args.microbatches, args.chunks)
    costs = Costs(forward=args.forward, backward=args.backward, input_grad=args.input_grad,
                  weight_grad=args.weight_grad, comm=args.comm)  # fmt: skip
    timeline = simulate(table, costs)
    print(table.format())
    print()
    print(format_gantt(timeline, args.width))
    closed = closed_form_bubble(table.name, table.pp_size, table.num_microbatches, table.num_chunks)
    print(
        f"\n{table.name}: pp={table.pp_size} microbatches={table.num_microbatches} "
        f"chunks={table.num_chunks} makespan={timeline.makespan:g} "
        f"bubble={timeline.bubble_fraction:.4f}"
        + (f" (closed form {closed:.4f})" if closed is not None else "")
    )
    if args.plot is not None:
        try:
            write_png(timeline, args.plot)
        except ImportError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
        else:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
