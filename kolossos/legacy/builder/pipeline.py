"""Building a pipeline stage with the legacy API (Colossal-AI's ``colossalai.builder.pipeline``):
:func:`build_pipeline_model` keeps this rank's layers of an ``nn.Sequential``,
:func:`build_pipeline_model_from_cfg` builds a :class:`ModelFromConfig` and keeps this rank's
range of its layers; both read the pipeline size and rank from ``gpc``. The partition helpers are
:mod:`kolossos.pipeline.partition`'s: per pipeline rank, a list with one ``(start, end)`` layer
range (``end`` exclusive) per model chunk, chunk ``c`` of rank ``r`` being virtual stage
``c * pipeline_size + r``.

Both builders build the whole model first (as the docs say: "build the whole model on CPU, then
split the model"), so a stage's layers carry exactly the weights the unsplit model built from the
same seed would have.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn

from kolossos.legacy.builder.model_from_config import ModelFromConfig, build_layer
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.registry import MODELS, build_from_registry
from kolossos.logging import get_dist_logger
from kolossos.pipeline import partition as _partition
from kolossos.pipeline.build import keep_layers, named_layers
from kolossos.pipeline.partition import Bounds

__all__ = [
    "build_model",
    "build_pipeline_model",
    "build_pipeline_model_from_cfg",
    "count_layer_params",
    "partition_balanced",
    "partition_uniform",
]

#: partition_method values: upstream's names and the docs' words for them
_METHODS = {"layer": "uniform", "uniform": "uniform", "parameter": "balanced",
            "balanced": "balanced"}  # fmt: skip


def partition_uniform(
    num_items: int, pipeline_parallel_size: int, num_chunks: int = 1
) -> list[Bounds]:
    """Per pipeline rank, one ``(start, end)`` range (``end`` exclusive) per model chunk: the
    ``num_items`` layers cut into ``num_chunks`` parts, each part into ``pipeline_parallel_size``
    stages whose sizes differ by at most one (later stages take the extra layers). ``start == 0``
    marks the first stage, ``end == num_items`` the last.

    Raises:
        ValueError: fewer layers than ``pipeline_parallel_size * num_chunks`` stages.

    Example:
        >>> partition_uniform(10, 2, 2)
        [[(0, 2), (5, 7)], [(2, 5), (7, 10)]]
    """
    return _partition.partition_uniform(num_items, pipeline_parallel_size, num_chunks)


def partition_balanced(
    weights: Sequence[float], pipeline_parallel_size: int, num_chunks: int = 1
) -> list[Bounds]:
    """As :func:`partition_uniform`, balancing the summed ``weights`` (one per layer, e.g. its
    parameter count): the contiguous split minimising the heaviest stage, stage ``s`` going to
    rank ``s % pipeline_parallel_size``.

    Raises:
        ValueError: fewer layers than stages, or a negative weight.

    Example:
        >>> partition_balanced([1, 1, 1, 9], 2)
        [[(0, 3)], [(3, 4)]]
    """
    return _partition.partition_balanced(weights, pipeline_parallel_size, num_chunks)


def pipeline_position() -> tuple[int, int]:
    """``(pipeline size, pipeline rank)`` from ``gpc`` (``(1, 0)`` without a PIPELINE group)."""
    if not gpc.is_initialized(ParallelMode.PIPELINE):
        return 1, 0
    return gpc.get_world_size(ParallelMode.PIPELINE), gpc.get_local_rank(ParallelMode.PIPELINE)


def _check_chunks(num_chunks: Any) -> int:
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks!r} must be an int >= 1 (model chunks per rank).")
    return num_chunks


def _log_parts(parts: list[Bounds], names: list[str]) -> None:
    lines = [f"Total {len(names)} layers"]
    for rank, ranges in enumerate(parts):
        for chunk, (start, end) in enumerate(ranges):
            lines.append(f"===== stage={rank}, chunk={chunk}, layers=[{start}-{end}) =====")
            lines += [f"\t{i:3d}: {names[i]}" for i in range(start, end)]
    get_dist_logger().info("\n".join(lines), ranks=[0])


def build_pipeline_model(
    layers: nn.Module, num_chunks: int = 1, verbose: bool = False
) -> nn.Module:
    """This pipeline rank's layers of ``layers``, split uniformly by layer count.

    Args:
        layers: the whole model as an ``nn.Sequential`` (or ``nn.ModuleList`` / list of layers).
        num_chunks: model chunks per rank (``> 1`` for ``InterleavedPipelineSchedule``).
        verbose: log every stage's layers (rank 0).

    Returns:
        An ``nn.Sequential`` of this rank's layers (named as in ``layers``, so state-dict keys
        match the whole model's), or an ``nn.ModuleList`` of one per chunk.

    Raises:
        TypeError: ``layers`` is not a sequence of layers.
        ValueError: fewer layers than ``pipeline size * num_chunks``.

    Example:
        >>> model = build_pipeline_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))  # pp = 1
        >>> len(model)
        2
    """
    named = named_layers(layers)
    size, rank = pipeline_position()
    parts = partition_uniform(len(named), size, _check_chunks(num_chunks))
    if verbose:
        _log_parts(parts, [f"({n}) {m}" for n, m in named])
    return keep_layers(named, parts[rank])


def build_model(config: Mapping[str, Any]) -> nn.Module:
    """A model from ``dict(type='Name', **kwargs)`` registered in ``MODELS``."""
    model = build_from_registry(config, MODELS)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model config {dict(config)!r} built a {type(model).__name__}.")
    return model


def count_layer_params(layers: list[nn.Module]) -> list[int]:
    """Trainable parameters of each layer."""
    return [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]


def build_pipeline_model_from_cfg(
    config: Mapping[str, Any],
    num_chunks: int = 1,
    partition_method: str = "parameter",
    verbose: bool = False,
) -> nn.Module:
    """Build the :class:`ModelFromConfig` that ``config`` names and keep this rank's layers.

    Args:
        config: ``dict(type='MyModel', **kwargs)``, ``MyModel`` registered in ``MODELS``.
        num_chunks: model chunks per rank.
        partition_method: ``'layer'`` (uniform by layer count; also ``'uniform'``) or
            ``'parameter'`` (balanced by parameter count; also ``'balanced'``).
        verbose: log every stage's layers (rank 0).

    Returns:
        A copy of the model holding this rank's layers in ``.layers`` (``.layer_range`` says
        which), or an ``nn.ModuleList`` of one copy per chunk.

    Raises:
        TypeError: the model is not a ``ModelFromConfig``.
        ValueError: an unknown ``partition_method`` or fewer layers than stages.

    Example:
        >>> @MODELS.register_module
        ... class TwoLayers(ModelFromConfig):
        ...     def __init__(self, width: int) -> None:
        ...         super().__init__()
        ...         self.layers_cfg = [dict(type="Linear", in_features=3, out_features=width),
        ...                            dict(type="Linear", in_features=width, out_features=2)]
        >>> build_pipeline_model_from_cfg(dict(type="TwoLayers", width=4)).layer_range
        (0, 2)
    """
    method = _METHODS.get(str(partition_method).lower())
    if method is None:
        raise ValueError(
            f"partition_method={partition_method!r} is unknown; use 'layer' (uniform by layer "
            "count) or 'parameter' (balanced by parameter count)."
        )
    chunks = _check_chunks(num_chunks)
    model = build_model(config)
    if not isinstance(model, ModelFromConfig):
        raise TypeError(
            f"{type(model).__name__} is not a ModelFromConfig: subclass "
            "kolossos.nn.model.ModelFromConfig and fill self.layers_cfg."
        )
    # the whole model, layer by layer in order: the unsplit model's weights for the same seed
    layers = [build_layer(cfg) for cfg in model.layers_cfg]
    size, rank = pipeline_position()
    if method == "uniform":
        parts = partition_uniform(len(layers), size, chunks)
    else:
        parts = partition_balanced(count_layer_params(layers), size, chunks)
    if verbose:
        _log_parts(parts, [str(cfg) for cfg in model.layers_cfg])
    stages = []
    for start, end in parts[rank]:
        stage = copy.deepcopy(model)  # holds no layers yet: copies only the model's own state
        stage.adopt_layers(layers[start:end], start)
        stages.append(stage)
    return stages[0] if len(stages) == 1 else nn.ModuleList(stages)
