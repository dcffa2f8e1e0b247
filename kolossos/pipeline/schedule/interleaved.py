"""Interleaved 1F1B: several model chunks per rank in the ``loop`` layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kolossos.pipeline.schedule.base import PipelineSchedule
from kolossos.pipeline.stage_manager import PipelineStageManager


class InterleavedSchedule(PipelineSchedule):
    """Interleaved 1F1B (Megatron's virtual pipeline): rank ``r`` holds chunks ``r``,
    ``r + p``, ``r + 2p``... of the model; the bubble shrinks by the chunk count for the price of
    ``v`` times more point-to-point messages. ``num_microbatches`` must be a multiple of the
    pipeline size; the stage manager's ``num_model_chunks`` is the chunk count.

    Takes Colossal-AI's positional order ``(stage_manager, num_model_chunks, num_microbatch,
    microbatch_size, enable_metadata_cache)`` as well as kolossos' keywords.

    Args:
        stage_manager: the pipeline's stage manager (its ``num_model_chunks`` is the chunk count).
        num_model_chunks: Colossal-AI's argument; must equal the stage manager's when given.
        num_microbatch: Colossal-AI's name of ``num_microbatches``.
        microbatch_size: the micro-batch size (instead of a count).
        enable_metadata_cache: reuse the shapes sent with the first micro-batch.
        num_microbatches: micro-batches per step.
        tensor_shape: fixed activation shape between stages (skips the metadata exchange).
        tensor_dtype: the activation dtype with ``tensor_shape``.
        schedule: the registered schedule name (``"interleaved"``).

    Raises:
        ValueError: ``num_model_chunks`` differs from the stage manager's, or both micro-batch
            counts are given and differ.

    Example:
        >>> manager = PipelineStageManager(mesh, "pp", num_model_chunks=2)  # doctest: +SKIP
        >>> schedule = InterleavedSchedule(manager, num_microbatches=8)  # doctest: +SKIP
        >>> schedule = InterleavedSchedule(manager, 2, 8)  # Colossal-AI's form  # doctest: +SKIP
    """

    name = "interleaved"

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_model_chunks: int | None = None,
        num_microbatch: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        *,
        num_microbatches: int | None = None,
        tensor_shape: Sequence[int] | None = None,
        tensor_dtype: torch.dtype = torch.float32,
        schedule: str | None = None,
    ) -> None:
        if num_model_chunks is not None and num_model_chunks != stage_manager.num_model_chunks:
            raise ValueError(
                f"num_model_chunks={num_model_chunks} but the stage manager holds "
                f"{stage_manager.num_model_chunks} chunks per rank; create the "
                f"PipelineStageManager with num_model_chunks={num_model_chunks}."
            )
        if None not in (num_microbatch, num_microbatches) and num_microbatch != num_microbatches:
            raise ValueError(
                f"num_microbatch={num_microbatch} and num_microbatches={num_microbatches} name "
                "the same count; give one."
            )
        super().__init__(
            stage_manager,
            num_microbatches if num_microbatches is not None else num_microbatch,
            microbatch_size,
            tensor_shape=tensor_shape,
            tensor_dtype=tensor_dtype,
            enable_metadata_cache=enable_metadata_cache,
            schedule=schedule,
        )
