"""Interleaved 1F1B: several model chunks per rank in the ``loop`` layout."""

from __future__ import annotations

from kolossos.pipeline.schedule.base import PipelineSchedule


class InterleavedSchedule(PipelineSchedule):
    """Interleaved 1F1B (Megatron's virtual pipeline): rank ``r`` holds chunks ``r``,
    ``r + p``, ``r + 2p``... of the model; the bubble shrinks by the chunk count for the price of
    ``v`` times more point-to-point messages. ``num_microbatches`` must be a multiple of the
    pipeline size; the stage manager's ``num_model_chunks`` is the chunk count.

    Example:
        >>> manager = PipelineStageManager(mesh, "pp", num_model_chunks=2)  # doctest: +SKIP
        >>> schedule = InterleavedSchedule(manager, num_microbatches=8)  # doctest: +SKIP
    """

    name = "interleaved"
