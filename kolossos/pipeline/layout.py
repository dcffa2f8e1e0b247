"""Where each virtual pipeline stage lives: pure arithmetic between ``(rank, chunk)`` and the
global stage index.

A pipeline of ``pp_size`` ranks with ``num_chunks`` model chunks per rank has
``pp_size * num_chunks`` virtual stages, numbered in the order the data flows through them.

* ``"loop"`` (interleaved 1F1B, Megatron's layout): chunk ``c`` of rank ``r`` is stage
  ``c * pp_size + r``; the data visits every rank once per chunk, wrapping from the last rank to
  the first.
* ``"v"`` (zero-bubble V schedules, exactly two chunks): chunk 0 of rank ``r`` is stage ``r`` and
  chunk 1 is stage ``2 * pp_size - 1 - r``; the data runs down the ranks and back up, so the
  first and the last stage are both on rank 0 and the turn happens inside the last rank.
"""

from __future__ import annotations

LAYOUTS = ("loop", "v")


def check_layout(pp_size: int, num_chunks: int, layout: str) -> None:
    """Validate a layout.

    Raises:
        ValueError: non-positive sizes, an unknown layout, or ``"v"`` without two chunks.
    """
    if pp_size < 1 or num_chunks < 1:
        raise ValueError(
            f"pp_size={pp_size} and num_chunks={num_chunks} must both be >= 1; pass positive sizes."
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; choose one of {LAYOUTS}.")
    if layout == "v" and num_chunks != 2:
        raise ValueError(
            f"the 'v' layout needs exactly 2 model chunks per rank, got num_chunks={num_chunks}; "
            "use layout='loop' for other counts."
        )


def stage_of(rank: int, chunk: int, pp_size: int, num_chunks: int, layout: str = "loop") -> int:
    """The global stage index of ``chunk`` on pipeline rank ``rank``."""
    check_layout(pp_size, num_chunks, layout)
    if not (0 <= rank < pp_size and 0 <= chunk < num_chunks):
        raise ValueError(
            f"(rank={rank}, chunk={chunk}) lies outside a pipeline of {pp_size} ranks with "
            f"{num_chunks} chunks each."
        )
    if layout == "v" and chunk == 1:
        return 2 * pp_size - 1 - rank
    return chunk * pp_size + rank


def owner_of(stage: int, pp_size: int, num_chunks: int, layout: str = "loop") -> tuple[int, int]:
    """``(rank, chunk)`` holding global stage ``stage``."""
    check_layout(pp_size, num_chunks, layout)
    if not 0 <= stage < pp_size * num_chunks:
        raise ValueError(f"stage {stage} lies outside [0, {pp_size * num_chunks}).")
    chunk, rank = divmod(stage, pp_size)
    if layout == "v" and chunk == 1:
        rank = pp_size - 1 - rank
    return rank, chunk
