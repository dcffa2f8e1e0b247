"""``build_pipeline_model``: keep this pipeline rank's layers of an ``nn.Sequential``, split by
the functions of :mod:`kolossos.pipeline.partition`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch.nn as nn

from kolossos.logging import get_dist_logger
from kolossos.pipeline.partition import partition_layers
from kolossos.pipeline.stage_manager import PipelineStageManager

__all__ = ["build_pipeline_model", "keep_layers", "named_layers"]


def named_layers(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of an ``nn.Sequential`` / ``nn.ModuleList`` (its children) or of a list
    of layers (named by index).

    Raises:
        TypeError: anything else.
    """
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return list(model.named_children())
    if isinstance(model, Sequence) and all(isinstance(m, nn.Module) for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    raise TypeError(
        f"build_pipeline_model takes an nn.Sequential or a list of layers, got "
        f"{type(model).__name__}; wrap the model's layers in nn.Sequential(...)."
    )


def build_pipeline_model(
    sequential_model: nn.Module | Sequence[nn.Module],
    num_chunks: int = 1,
    verbose: bool = False,
    *,
    stage_manager: PipelineStageManager | None = None,
    method: str = "uniform",
    layers_per_stage: Sequence[int] | None = None,
) -> nn.Module:
    """Keep this pipeline rank's layers of ``sequential_model``.

    Args:
        sequential_model: an ``nn.Sequential`` (or a list of layers) of the whole model.
        num_chunks: model chunks per rank (interleaved schedules).
        verbose: log each rank's layer ranges.
        stage_manager: a :class:`~kolossos.pipeline.PipelineStageManager`; default: every process
            of the job is one pipeline stage (one process without torch.distributed).
        method: ``uniform`` (by layers) or ``balanced`` (by parameter count).
        layers_per_stage: explicit layer counts per stage (overrides ``method``).

    Returns:
        With one chunk, an ``nn.Sequential`` of this rank's layers (keeping their names, so its
        ``state_dict`` keys match the full model's); otherwise an ``nn.ModuleList`` of them.
    """
    layers = named_layers(sequential_model)
    if stage_manager is None:
        stage_manager = PipelineStageManager.default(num_model_chunks=num_chunks)
    if stage_manager.num_model_chunks != num_chunks:
        raise ValueError(
            f"num_chunks={num_chunks} differs from the stage manager's num_model_chunks="
            f"{stage_manager.num_model_chunks}; pass the same value to both."
        )
    parts = partition_layers([m for _, m in layers], stage_manager.pp_size, num_chunks,
                             method=method, layers_per_stage=layers_per_stage,
                             layout=stage_manager.layout)[stage_manager.stage]  # fmt: skip
    if verbose:
        ranges = ", ".join(f"chunk {c}: layers {s}-{e}" for c, (s, e) in enumerate(parts))
        get_dist_logger().info(f"pipeline rank {stage_manager.stage}: {ranges}")
    return keep_layers(layers, parts)


def keep_layers(
    layers: Sequence[tuple[str, nn.Module]], parts: Sequence[tuple[int, int]]
) -> nn.Module:
    """One rank's chunks: an ``nn.Sequential`` of ``layers[start:end]`` per ``(start, end)`` in
    ``parts`` (keeping the layers' names, so ``state_dict`` keys match the whole model's); the
    single chunk itself, or an ``nn.ModuleList`` of several."""
    chunks = [nn.Sequential(OrderedDict(layers[start:end])) for start, end in parts]
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
