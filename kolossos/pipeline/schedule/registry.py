"""The one registration of every pipeline schedule, which everything else reads.

A schedule is a :class:`ScheduleSpec`: its name, its table builder (a pure function, see
:mod:`~kolossos.pipeline.schedule.tables` and :mod:`~kolossos.pipeline.schedule.zero_bubble`),
its chunk rules, the chunk layout and backward split of its tables and its closed-form bubble.
:func:`build_table`, :func:`~kolossos.pipeline.schedule.create_schedule`, the schedule classes
and the simulator (``python -m kolossos.pipeline.simulate --schedule``) look schedules up here,
and :func:`check_num_chunks` serves configuration checks such as the plugin's ``pp_style`` /
``num_model_chunks``; so a new schedule needs only its table builder and one
:func:`register_schedule` call (or one entry in :data:`BUILTIN_SCHEDULES` for a built-in one).

Example:
    >>> from kolossos.pipeline.schedule.tables import gpipe_table
    >>> spec = ScheduleSpec(name="my-gpipe", builder=lambda p, m, v: gpipe_table(p, m))
    >>> _ = register_schedule(spec)
    >>> build_table("my-gpipe", 2, 4).name
    'my-gpipe'
    >>> _ = unregister_schedule("my-gpipe")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kolossos.pipeline.layout import LAYOUTS
from kolossos.pipeline.schedule.table import ScheduleTable, validate_table
from kolossos.pipeline.schedule.tables import (
    gpipe_bubble,
    gpipe_table,
    interleaved_bubble,
    interleaved_table,
    one_f_one_b_table,
)
from kolossos.pipeline.schedule.zero_bubble import zbh1_bubble, zbh1_table, zbv_bubble, zbv_table

__all__ = [
    "BUILTIN_SCHEDULES",
    "SCHEDULES",
    "ScheduleSpec",
    "build_table",
    "check_num_chunks",
    "register_schedule",
    "schedule_names",
    "schedule_spec",
    "unregister_schedule",
]

#: ``(pp_size, num_microbatches, num_chunks) -> ScheduleTable``
TableBuilder = Callable[[int, int, int], ScheduleTable]
#: ``(pp_size, num_microbatches, num_chunks) -> bubble fraction`` (``None``: no formula there)
BubbleFormula = Callable[[int, int, int], float | None]


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """Everything kolossos needs to know about one pipeline schedule.

    Raises:
        ValueError: an empty name, an unknown layout or inconsistent chunk counts.
    """

    name: str
    """the schedule's name, as ``build_table``, ``create_schedule`` and the simulator's
    ``--schedule`` take it"""
    builder: TableBuilder
    """``(pp_size, num_microbatches, num_chunks) -> ScheduleTable``, a pure function; it raises
    ``ValueError`` for sizes it cannot schedule. The table is renamed to :attr:`name`, so a
    builder may reuse another schedule's table function."""
    default_chunks: int = 1
    """model chunks per rank when the caller gives none"""
    fixed_chunks: int | None = 1
    """the only chunk count the schedule runs, or ``None`` when any positive count works (as
    for ``interleaved``)"""
    layout: str = "loop"
    """stage placement of the tables, which the stage manager must use (``"loop"`` or ``"v"``,
    :mod:`kolossos.pipeline.layout`)"""
    split_backward: bool = False
    """whether the tables split the backward into ``B`` (input gradient) and ``W`` (weight
    gradient)"""
    closed_form: BubbleFormula | None = None
    """the textbook bubble fraction ``(pp_size, num_microbatches, num_chunks) -> float`` with
    ``F = 1, B = 2`` (``F = B = W = 1`` when split) and free communication, returning ``None``
    where the formula does not hold; ``None`` when there is no closed form at all"""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ScheduleSpec name={self.name!r} must be a non-empty string.")
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"schedule {self.name!r}: layout={self.layout!r} is unknown; choose one of "
                f"{LAYOUTS}."
            )
        for field in ("default_chunks", "fixed_chunks"):
            value = getattr(self, field)
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"schedule {self.name!r}: {field}={value!r} must be an int >= 1.")
        if self.fixed_chunks is not None and self.default_chunks != self.fixed_chunks:
            raise ValueError(
                f"schedule {self.name!r}: default_chunks={self.default_chunks} differs from "
                f"fixed_chunks={self.fixed_chunks}; make them equal."
            )


#: the schedules kolossos ships, registered at import (edit here to add a built-in one)
BUILTIN_SCHEDULES: tuple[ScheduleSpec, ...] = (
    ScheduleSpec(name="gpipe", builder=lambda p, m, v: gpipe_table(p, m), closed_form=gpipe_bubble),
    ScheduleSpec(
        name="1f1b", builder=lambda p, m, v: one_f_one_b_table(p, m), closed_form=gpipe_bubble
    ),
    ScheduleSpec(
        name="interleaved",
        builder=interleaved_table,
        default_chunks=2,
        fixed_chunks=None,
        closed_form=interleaved_bubble,
    ),
    ScheduleSpec(
        name="zbh1",
        builder=lambda p, m, v: zbh1_table(p, m),
        split_backward=True,
        closed_form=zbh1_bubble,
    ),
    ScheduleSpec(
        name="zbv",
        builder=lambda p, m, v: zbv_table(p, m),
        default_chunks=2,
        fixed_chunks=2,
        layout="v",
        split_backward=True,
        closed_form=zbv_bubble,
    ),
)

_REGISTRY: dict[str, ScheduleSpec] = {spec.name: spec for spec in BUILTIN_SCHEDULES}

#: name -> :class:`ScheduleSpec` of every registered schedule (a read-only live view, in
#: registration order; change it with :func:`register_schedule` / :func:`unregister_schedule`)
SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType(_REGISTRY)


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Make ``spec`` available to :func:`build_table`, ``create_schedule`` and the simulator.

    Args:
        spec: the schedule.
        replace: allow replacing a registered schedule of the same name.

    Returns:
        ``spec``.

    Raises:
        TypeError: ``spec`` is not a :class:`ScheduleSpec`.
        ValueError: the name is taken and ``replace`` is false.
    """
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register_schedule takes a ScheduleSpec, got {type(spec).__name__}.")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(
            f"pipeline schedule {spec.name!r} is already registered; pick another name, or pass "
            "replace=True to override it."
        )
    _REGISTRY[spec.name] = spec
    return spec


def unregister_schedule(name: str) -> ScheduleSpec:
    """Remove schedule ``name`` from the registry.

    Returns:
        Its :class:`ScheduleSpec` (register it again to restore it).

    Raises:
        ValueError: ``name`` is not registered.
    """
    spec = schedule_spec(name)
    del _REGISTRY[name]
    return spec


def schedule_names() -> tuple[str, ...]:
    """The registered schedule names, sorted."""
    return tuple(sorted(_REGISTRY))


def schedule_spec(name: str) -> ScheduleSpec:
    """The registration of schedule ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the registered names).
    """
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; choose one of {list(schedule_names())}, or "
            "register a new one with register_schedule(ScheduleSpec(...))."
        )
    return spec


def check_num_chunks(name: str, num_chunks: int | None, *, arg: str = "num_chunks") -> int:
    """Check a model-chunk count against schedule ``name``.

    Args:
        name: a registered schedule.
        num_chunks: model chunks per rank; ``None`` means the schedule's default.
        arg: the caller's name for the count, used in the error message (e.g.
            ``"num_model_chunks"``).

    Returns:
        The chunk count to use (the schedule's default for ``None``).

    Raises:
        ValueError: an unknown schedule, a count that is not a positive int, or a count other
            than the one the schedule runs.
    """
    spec = schedule_spec(name)
    if num_chunks is None:
        return spec.default_chunks
    if not _is_positive_int(num_chunks):
        raise ValueError(f"{arg}={num_chunks!r} must be an int >= 1; pass a positive count.")
    fixed = spec.fixed_chunks
    if fixed is not None and num_chunks != fixed:
        free = [n for n in schedule_names() if _REGISTRY[n].fixed_chunks is None]
        other = f", or use a schedule that takes any count ({', '.join(map(repr, free))})"
        raise ValueError(
            f"schedule {name!r} runs {fixed} model chunk(s) per rank, got {arg}={num_chunks}; "
            f"set {arg}={fixed}{other if free else ''}."
        )
    return num_chunks


def build_table(
    name: str, pp_size: int, num_microbatches: int, num_chunks: int | None = None
) -> ScheduleTable:
    """The validated table of schedule ``name``.

    Args:
        name: a registered schedule.
        pp_size: pipeline ranks.
        num_microbatches: micro-batches per step.
        num_chunks: model chunks per rank (default: the schedule's).

    Raises:
        ValueError: an unknown name, a chunk count the schedule does not support, sizes its
            builder rejects, or a builder whose table disagrees with its registration.
    """
    spec = schedule_spec(name)
    chunks = check_num_chunks(name, num_chunks)
    table = spec.builder(pp_size, num_microbatches, chunks)
    got = (table.pp_size, table.num_microbatches, table.num_chunks, table.layout,
           table.split_backward)  # fmt: skip
    want = (pp_size, num_microbatches, chunks, spec.layout, spec.split_backward)
    if got != want:
        raise ValueError(
            f"the builder of schedule {name!r} made a table with (pp_size, num_microbatches, "
            f"num_chunks, layout, split_backward)={got}, its registration says {want}; fix the "
            "builder or the ScheduleSpec."
        )
    if table.name != name:
        table = dataclasses.replace(table, name=name)
    validate_table(table)
    return table
