"""Non-interleaved schedules: GPipe and 1F1B (one chunk per rank).

Their tables and chunk rules are registered in :mod:`kolossos.pipeline.schedule.registry`; the
classes only name them.
"""

from __future__ import annotations

from kolossos.pipeline.schedule.base import PipelineSchedule


class OneForwardOneBackwardSchedule(PipelineSchedule):
    """1F1B: after ``p - r - 1`` warm-up forwards, rank ``r`` alternates one forward and one
    backward, so at most ``p - r`` micro-batches are in flight on it.

    Example:
        >>> schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=8)  # doctest: +SKIP
        >>> out = schedule.forward_backward_step(stage, iter([(x, y)]), loss_fn)  # doctest: +SKIP
        >>> out["loss"]  # on the last stage; None elsewhere  # doctest: +SKIP
    """

    name = "1f1b"


class GPipeSchedule(PipelineSchedule):
    """GPipe: all forwards, then all backwards (``m`` micro-batches in flight); the baseline
    the other schedules improve on."""

    name = "gpipe"
