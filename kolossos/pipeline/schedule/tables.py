"""Closed-form schedule tables: GPipe, non-interleaved 1F1B and interleaved 1F1B, and their
textbook bubble fractions.

Pure functions of the pipeline size, the micro-batch count and the chunk count; the zero-bubble
tables come from the list scheduler in :mod:`kolossos.pipeline.schedule.zero_bubble`. Each is
registered in :mod:`kolossos.pipeline.schedule.registry`.
"""

from __future__ import annotations

from kolossos.pipeline.schedule.table import Action, ActionKind, ScheduleTable

F, B = ActionKind.F, ActionKind.B


def _check(pp_size: int, num_microbatches: int) -> None:
    if pp_size < 1 or num_microbatches < 1:
        raise ValueError(
            f"pp_size={pp_size} and num_microbatches={num_microbatches} must both be >= 1."
        )


def gpipe_table(pp_size: int, num_microbatches: int) -> ScheduleTable:
    """GPipe: every rank runs all forwards, then all backwards (``m`` activations in flight)."""
    _check(pp_size, num_microbatches)
    m = num_microbatches
    rank_actions = tuple(
        tuple([Action(F, 0, i) for i in range(m)] + [Action(B, 0, i) for i in range(m)])
        for _ in range(pp_size)
    )
    return ScheduleTable(
        name="gpipe",
        pp_size=pp_size,
        num_chunks=1,
        num_microbatches=m,
        layout="loop",
        split_backward=False,
        ranks=rank_actions,
    )


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then alternate one forward and one backward, then the remaining
    backwards."""
    warmup = min(warmup, len(forwards))
    out = forwards[:warmup]
    for j in range(len(forwards) - warmup):
        out += [forwards[warmup + j], backwards[j]]
    return out + backwards[len(forwards) - warmup :]


def one_f_one_b_table(pp_size: int, num_microbatches: int) -> ScheduleTable:
    """Non-interleaved 1F1B (PipeDream-flush): rank ``r`` runs ``p - r - 1`` warm-up forwards,
    then one forward and one backward in turn, then the remaining backwards, so at most
    ``p - r`` micro-batches are in flight on it."""
    _check(pp_size, num_microbatches)
    m = num_microbatches
    rank_actions = []
    for rank in range(pp_size):
        forwards = [Action(F, 0, i) for i in range(m)]
        backwards = [Action(B, 0, i) for i in range(m)]
        rank_actions.append(tuple(_one_f_one_b(forwards, backwards, pp_size - rank - 1)))
    return ScheduleTable(
        name="1f1b",
        pp_size=pp_size,
        num_chunks=1,
        num_microbatches=m,
        layout="loop",
        split_backward=False,
        ranks=tuple(rank_actions),
    )


def interleaved_order(
    pp_size: int, num_chunks: int, num_microbatches: int
) -> list[tuple[int, int]]:
    """``(chunk, micro-batch)`` in the order every rank runs its forwards: groups of ``pp_size``
    micro-batches, each group through chunk 0, then chunk 1, ... (backwards: chunks reversed)."""
    out = []
    for k in range(num_chunks * num_microbatches):
        group, offset = divmod(k, pp_size)
        out.append((group % num_chunks, (group // num_chunks) * pp_size + offset))
    return out


def interleaved_table(pp_size: int, num_microbatches: int, num_chunks: int) -> ScheduleTable:
    """Interleaved 1F1B (Megatron's virtual pipeline) on the ``loop`` layout.

    Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p`` forwards (all of them when that is
    more), then alternates forward and backward.

    Raises:
        ValueError: ``num_microbatches`` is not a multiple of ``pp_size``.
    """
    _check(pp_size, num_microbatches)
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1.")
    if num_microbatches % pp_size:
        fix = pp_size * max(1, num_microbatches // pp_size)
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches ({num_microbatches}) to be a multiple of "
            f"the pipeline size ({pp_size}); choose e.g. {fix}."
        )
    order = interleaved_order(pp_size, num_chunks, num_microbatches)
    forwards = [Action(F, c, i) for c, i in order]
    backwards = [Action(B, num_chunks - 1 - c, i) for c, i in order]
    rank_actions = []
    for rank in range(pp_size):
        warmup = 2 * (pp_size - rank - 1) + (num_chunks - 1) * pp_size
        rank_actions.append(tuple(_one_f_one_b(forwards, backwards, warmup)))
    return ScheduleTable(
        name="interleaved",
        pp_size=pp_size,
        num_chunks=num_chunks,
        num_microbatches=num_microbatches,
        layout="loop",
        split_backward=False,
        ranks=tuple(rank_actions),
    )


def gpipe_bubble(pp_size: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """GPipe's (and 1F1B's: it reorders, not shortens) bubble fraction ``(p-1)/(m+p-1)`` with
    ``F = 1, B = 2`` and free communication; ``num_chunks`` is ignored."""
    p, m = pp_size, num_microbatches
    return (p - 1) / (m + p - 1)


def interleaved_bubble(pp_size: int, num_microbatches: int, num_chunks: int) -> float:
    """Interleaved 1F1B's bubble fraction with ``v`` chunks per rank: ``(p-1)/(v m+p-1)``."""
    p, m, v = pp_size, num_microbatches, num_chunks
    return (p - 1) / (v * m + p - 1)
