"""Which step schedule ``kolossos.initialize`` gives the Engine, from the launch config, as
Colossal-AI does: :class:`NonPipelineSchedule` without pipeline parallelism; with
``parallel.pipeline > 1``, :class:`InterleavedPipelineSchedule` when the config has
``model=dict(num_chunks=...)`` or ``NUM_CHUNKS > 1``, else :class:`PipelineSchedule`, both with
``NUM_MICRO_BATCHES``, ``TENSOR_SHAPE`` and, under ``tensor=dict(mode='1d')``,
``scatter_gather_tensors``. Also the gradient-handler entries pipeline parallelism needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from kolossos.legacy.engine.schedule.base import BaseSchedule
from kolossos.legacy.engine.schedule.interleaved import (
    InterleavedPipelineSchedule,
    check_interleaved_microbatches,
)
from kolossos.legacy.engine.schedule.non_pipeline import NonPipelineSchedule
from kolossos.legacy.engine.schedule.pipeline import PipelineSchedule, _positive_int, _shape
from kolossos.pipeline.shared import shared_wrapper_of

__all__ = ["build_schedule", "check_pipeline_config", "with_pipeline_handlers"]

SHARED_HANDLER = "PipelineSharedModuleGradientHandler"


def _num_chunks(config: Mapping[str, Any]) -> int | None:
    """The interleaved chunk count: ``model.num_chunks`` (upstream's key, any value), or
    ``NUM_CHUNKS`` when above 1 (the docs' key); ``None``: not interleaved.

    Raises:
        ValueError: a value that is not a positive int, or the two keys disagree.
    """
    model = config.get("model")
    from_model = None
    if isinstance(model, Mapping) and "num_chunks" in model:
        from_model = _positive_int("model.num_chunks", model["num_chunks"])
    from_key = config.get("NUM_CHUNKS")
    if from_key is not None:
        from_key = _positive_int("NUM_CHUNKS", from_key)
        if from_model is not None and from_model != from_key:
            raise ValueError(
                f"NUM_CHUNKS={from_key} and model.num_chunks={from_model} disagree; set one of "
                "them (the model chunks per pipeline rank)."
            )
        if from_key == 1:
            return from_model
    return from_model if from_model is not None else from_key


def _scatter_gather(config: Mapping[str, Any]) -> bool:
    """Upstream's rule: scatter/gather the activations under 1D tensor parallelism."""
    parallel = config.get("parallel")
    tensor = parallel.get("tensor") if isinstance(parallel, Mapping) else None
    return isinstance(tensor, Mapping) and tensor.get("mode") == "1d"


def check_pipeline_config(config: Mapping[str, Any], pipeline_size: int) -> None:
    """Check the keys the pipeline schedules read, locally (every rank raises the same error
    before any collective). Nothing to check when ``pipeline_size`` is 1.

    Raises:
        ValueError: ``NUM_MICRO_BATCHES`` missing or not a positive int, ``model.num_chunks``
            or ``NUM_CHUNKS`` not a positive int (or the two disagree), a micro-batch count
            that is not a multiple of the pipeline size for the interleaved schedule, or a bad
            ``TENSOR_SHAPE``.
        TypeError: ``TENSOR_SHAPE`` is not a sequence of ints.
        NotImplementedError: ``gradient_accumulation`` together with pipeline parallelism.
    """
    if pipeline_size <= 1:
        return
    if "NUM_MICRO_BATCHES" not in config:
        raise ValueError(
            f"parallel.pipeline={pipeline_size} needs NUM_MICRO_BATCHES in the config (the "
            "micro-batches each batch is cut into, e.g. NUM_MICRO_BATCHES = 4); the batch size "
            "must be a multiple of it."
        )
    micro = _positive_int("NUM_MICRO_BATCHES", config["NUM_MICRO_BATCHES"])
    if _num_chunks(config) is not None:
        check_interleaved_microbatches(micro, pipeline_size)
    _shape(config.get("TENSOR_SHAPE"))
    if config.get("gradient_accumulation") is not None:
        raise NotImplementedError(
            f"gradient_accumulation={config['gradient_accumulation']} with parallel.pipeline="
            f"{pipeline_size} is not supported (the accumulation wrapper counts backward passes, "
            "and a pipeline step runs one per micro-batch); raise NUM_MICRO_BATCHES and the "
            "batch size instead."
        )


def build_schedule(config: Mapping[str, Any], pipeline_size: int = 1) -> BaseSchedule:
    """The Engine's schedule for ``config`` (``gpc.config``) and the pipeline size.

    Args:
        config: the launch config (reads ``NUM_MICRO_BATCHES``, ``TENSOR_SHAPE``,
            ``model.num_chunks``, ``NUM_CHUNKS``, ``parallel.tensor.mode``).
        pipeline_size: ``gpc.pipeline_parallel_size``.

    Raises:
        ValueError, TypeError, NotImplementedError: as :func:`check_pipeline_config`.

    Example:
        >>> type(build_schedule({}, 1)).__name__
        'NonPipelineSchedule'
        >>> type(build_schedule({"NUM_MICRO_BATCHES": 4}, 2)).__name__
        'PipelineSchedule'
    """
    if pipeline_size <= 1:
        return NonPipelineSchedule()
    check_pipeline_config(config, pipeline_size)
    micro = config["NUM_MICRO_BATCHES"]
    shape = config.get("TENSOR_SHAPE")
    chunks = _num_chunks(config)
    gather = _scatter_gather(config)
    if chunks is not None:
        return InterleavedPipelineSchedule(
            micro, chunks, tensor_shape=shape, scatter_gather_tensors=gather
        )
    return PipelineSchedule(micro, tensor_shape=shape, scatter_gather_tensors=gather)


def has_shared_parameters(model: nn.Module) -> bool:
    """Whether ``model`` holds parameters registered with a ``PipelineSharedModuleWrapper``."""
    return any(shared_wrapper_of(p) is not None for p in model.parameters())


def with_pipeline_handlers(
    entries: list[dict[str, Any]] | None, model: nn.Module
) -> list[dict[str, Any]] | None:
    """``entries`` plus ``PipelineSharedModuleGradientHandler`` when ``model`` holds shared
    parameters and the entries do not name it yet (as upstream adds it)."""
    if not has_shared_parameters(model):
        return entries
    entries = list(entries or [])
    if not any(e.get("type") == SHARED_HANDLER for e in entries):
        entries.append(dict(type=SHARED_HANDLER))
    return entries
