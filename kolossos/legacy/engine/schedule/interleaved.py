"""``InterleavedPipelineSchedule``: Colossal-AI's legacy interleaved 1F1B (Megatron's virtual
pipeline), run on kolossos' pipeline runtime over ``gpc``'s PIPELINE group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.schedule.pipeline import PipelineSchedule, _positive_int
from kolossos.legacy.engine.schedule.pipeline_data import StageDataFunc

__all__ = ["InterleavedPipelineSchedule", "check_interleaved_microbatches"]


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int) -> None:
    """Colossal-AI's rule: the micro-batch count is a multiple of the pipeline size.

    Raises:
        ValueError: it is not.
    """
    if num_microbatches % pipeline_size:
        fix = pipeline_size * max(1, round(num_microbatches / pipeline_size))
        raise ValueError(
            f"InterleavedPipelineSchedule needs num_microbatches ({num_microbatches}) to be a "
            f"multiple of the pipeline size ({pipeline_size}); set NUM_MICRO_BATCHES to e.g. "
            f"{fix}."
        )


class InterleavedPipelineSchedule(PipelineSchedule):
    """Interleaved 1F1B over ``num_model_chunks`` chunks per pipeline rank (Colossal-AI's
    ``InterleavedPipelineSchedule``).

    ``engine.model`` is an ``nn.ModuleList`` (or list) of this rank's chunks: chunk ``c`` of
    pipeline rank ``r`` of ``p`` is virtual stage ``c * p + r``, so data flows through chunk 0 of
    every rank, then chunk 1 of every rank, and so on (the last rank feeds the first). Forwards
    run in groups of ``p`` micro-batches through chunk 0, then chunk 1, ...; rank ``r`` warms up
    with ``2 (p - r - 1) + (v - 1) p`` forwards, then alternates forward and backward. During a
    chunk's forward, ``gpc.is_pipeline_first_stage()`` / ``is_pipeline_last_stage()`` answer for
    that chunk (gpc's virtual pipeline rank is set).

    Args:
        num_microbatches: micro-batches per step, a multiple of the pipeline size.
        num_model_chunks: chunks per pipeline rank (the config's ``model=dict(num_chunks=...)``).
        data_process_func: as :class:`PipelineSchedule`.
        tensor_shape: as :class:`PipelineSchedule`.
        scatter_gather_tensors: as :class:`PipelineSchedule`.
        tensor_dtype: as :class:`PipelineSchedule`.

    Raises:
        ValueError: ``num_model_chunks`` < 1, or (when the PIPELINE group exists)
            ``num_microbatches`` that is not a multiple of the pipeline size; at the Engine,
            an ``engine.model`` without ``num_model_chunks`` chunks.

    Example:
        >>> # config: parallel=dict(pipeline=2), NUM_MICRO_BATCHES=4, model=dict(num_chunks=2)
        >>> schedule = InterleavedPipelineSchedule(4, num_model_chunks=2)  # doctest: +SKIP
    """

    _table_name = "interleaved"

    def __init__(
        self,
        num_microbatches: int,
        num_model_chunks: int,
        data_process_func: StageDataFunc | None = None,
        tensor_shape: torch.Size | Sequence[int] | None = None,
        scatter_gather_tensors: bool = False,
        *,
        tensor_dtype: torch.dtype | None = None,
    ) -> None:
        num_microbatches = _positive_int("num_microbatches", num_microbatches)
        self.num_model_chunks = _positive_int("num_model_chunks", num_model_chunks)
        if gpc.is_initialized(ParallelMode.PIPELINE):
            check_interleaved_microbatches(
                num_microbatches, gpc.get_world_size(ParallelMode.PIPELINE)
            )
        super().__init__(
            num_microbatches,
            data_process_func,
            tensor_shape,
            scatter_gather_tensors,
            tensor_dtype=tensor_dtype,
        )
        # as Colossal-AI: gpc.is_pipeline_first/last_stage() answer for the running chunk
        gpc.set_virtual_pipeline_parallel_size(self.num_model_chunks)
        gpc.set_virtual_pipeline_parallel_rank(0)

    def _set_chunk(self, chunk: int) -> None:
        gpc.set_virtual_pipeline_parallel_rank(chunk)
