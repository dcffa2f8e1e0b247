"""Schedule names and their table builders (the names ``--schedule`` and the plugin accept)."""

from __future__ import annotations

from collections.abc import Callable

from kolossos.pipeline.schedule.table import ScheduleTable, validate_table
from kolossos.pipeline.schedule.tables import gpipe_table, interleaved_table, one_f_one_b_table
from kolossos.pipeline.schedule.zero_bubble import zbh1_table, zbv_table

#: name -> (builder(pp_size, num_microbatches, num_chunks), default chunks, fixed chunks or None)
SCHEDULES: dict[str, tuple[Callable[[int, int, int], ScheduleTable], int, int | None]] = {
    "gpipe": (lambda p, m, v: gpipe_table(p, m), 1, 1),
    "1f1b": (lambda p, m, v: one_f_one_b_table(p, m), 1, 1),
    "interleaved": (lambda p, m, v: interleaved_table(p, m, v), 2, None),
    "zbh1": (lambda p, m, v: zbh1_table(p, m), 1, 1),
    "zbv": (lambda p, m, v: zbv_table(p, m), 2, 2),
}


def build_table(
    name: str, pp_size: int, num_microbatches: int, num_chunks: int | None = None
) -> ScheduleTable:
    """The validated table of schedule ``name``.

    Raises:
        ValueError: an unknown name, or a chunk count the schedule does not support.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}.")
    builder, default, fixed = SCHEDULES[name]
    chunks = default if num_chunks is None else num_chunks
    if fixed is not None and chunks != fixed:
        raise ValueError(
            f"schedule {name!r} runs {fixed} model chunk(s) per rank, got num_chunks={chunks}; "
            f"{'drop the argument' if fixed == 1 else f'pass {fixed}'} or use 'interleaved'."
        )
    table = builder(pp_size, num_microbatches, chunks)
    validate_table(table)
    return table
