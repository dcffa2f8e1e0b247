"""Splitting a model's layers into pipeline stages: uniformly by layer count, balanced by
parameter count, or by an explicit number of layers per stage (pure functions;
:func:`kolossos.pipeline.build.build_pipeline_model` applies them to an ``nn.Sequential``).

Stages are contiguous ranges ``(start, end)`` of layer indices, ``end`` exclusive, in data-flow
order; :mod:`kolossos.pipeline.layout` says which ``(rank, chunk)`` holds each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from kolossos.pipeline import layout as _layout

Bounds = list[tuple[int, int]]
METHODS = ("uniform", "balanced")


def _stages(pipeline_size: int, num_chunks: int, layout: str, num_layers: int) -> int:
    _layout.check_layout(pipeline_size, num_chunks, layout)
    stages = pipeline_size * num_chunks
    if num_layers < stages:
        raise ValueError(
            f"{num_layers} layers cannot fill {stages} stages ({pipeline_size} ranks x "
            f"{num_chunks} chunks): every stage needs at least one layer; use fewer ranks or "
            "chunks, or split the model into more layers."
        )
    return stages


def uniform_bounds(num_layers: int, num_stages: int) -> Bounds:
    """``num_stages`` contiguous ranges whose sizes differ by at most one (the last stages take
    the extra layers)."""
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s >= num_stages - extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def balanced_bounds(weights: Sequence[float], num_stages: int) -> Bounds:
    """Contiguous ranges minimising the heaviest stage's total weight (e.g. parameter counts);
    ties go to the split with the most even layer counts. Every stage gets at least one layer.

    Dynamic programming over (layers, stages): ``O(stages * layers^2)``, instant for models with
    up to thousands of layers.
    """
    n = len(weights)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"{n} layers cannot fill {num_stages} stages (one layer each at least).")
    prefix = [0.0]
    for w in weights:
        if w < 0:
            raise ValueError(f"layer weights must be >= 0, got {w}.")
        prefix.append(prefix[-1] + float(w))
    inf = (float("inf"), float("inf"))
    # best[k][i]: (max stage weight, max stage length) splitting layers [0, i) into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                cand = (max(prev[0], prefix[i] - prefix[j]), max(prev[1], i - j))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def chunked_uniform_bounds(num_layers: int, pipeline_size: int, num_chunks: int) -> Bounds:
    """Uniform stage ranges, model chunk by model chunk (Colossal-AI's ``partition_uniform``):
    the layers are first cut into ``num_chunks`` contiguous parts whose sizes differ by at most
    one, then each part into ``pipeline_size`` stages the same way (later parts and stages take
    the extra layers). With one chunk this is :func:`uniform_bounds`.

    Example:
        >>> chunked_uniform_bounds(6, 2, 2)
        [(0, 1), (1, 3), (3, 4), (4, 6)]
    """
    bounds: Bounds = []
    for start, end in uniform_bounds(num_layers, num_chunks):
        bounds += [(start + a, start + b) for a, b in uniform_bounds(end - start, pipeline_size)]
    return bounds


def bounds_from_counts(layers_per_stage: Sequence[int], num_layers: int) -> Bounds:
    """Ranges from an explicit number of layers per stage.

    Raises:
        ValueError: a count below 1, or counts that do not add up to ``num_layers``.
    """
    if any(c < 1 for c in layers_per_stage) or sum(layers_per_stage) != num_layers:
        raise ValueError(
            f"layers_per_stage={list(layers_per_stage)} must be positive and sum to the "
            f"{num_layers} layers of the model."
        )
    bounds, start = [], 0
    for count in layers_per_stage:
        bounds.append((start, start + count))
        start += count
    return bounds


def per_rank(bounds: Bounds, pipeline_size: int, num_chunks: int, layout: str) -> list[Bounds]:
    """Regroup stage ranges by rank: ``out[r][c]`` is the range of chunk ``c`` on rank ``r``."""
    out: list[Bounds] = [[(0, 0)] * num_chunks for _ in range(pipeline_size)]
    for stage, rng in enumerate(bounds):
        rank, chunk = _layout.owner_of(stage, pipeline_size, num_chunks, layout)
        out[rank][chunk] = rng
    return out


def partition_uniform(
    num_layers: int, pipeline_size: int, num_chunks: int = 1, layout: str = "loop"
) -> list[Bounds]:
    """Per rank, the ``(start, end)`` layer range (``end`` exclusive) of each of its chunks, from
    a uniform split (:func:`chunked_uniform_bounds`: chunk by chunk, as Colossal-AI's
    ``colossalai.builder.pipeline.partition_uniform``). ``start == 0`` marks the first stage and
    ``end == num_layers`` the last.

    Raises:
        ValueError: fewer layers than stages (``pipeline_size * num_chunks``), or a bad layout.

    Example:
        >>> partition_uniform(8, 2, 2)
        [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
        >>> partition_uniform(5, 2, 1)
        [[(0, 2)], [(2, 5)]]
    """
    _stages(pipeline_size, num_chunks, layout, num_layers)
    bounds = chunked_uniform_bounds(num_layers, pipeline_size, num_chunks)
    return per_rank(bounds, pipeline_size, num_chunks, layout)


def partition_balanced(
    weights: Sequence[float], pipeline_size: int, num_chunks: int = 1, layout: str = "loop"
) -> list[Bounds]:
    """Like :func:`partition_uniform`, balancing the summed ``weights`` (one per layer, e.g. its
    parameter count) instead of the layer counts."""
    stages = _stages(pipeline_size, num_chunks, layout, len(weights))
    return per_rank(balanced_bounds(weights, stages), pipeline_size, num_chunks, layout)


def partition_layers(
    layers: Sequence[nn.Module],
    pipeline_size: int,
    num_chunks: int = 1,
    *,
    method: str = "uniform",
    layers_per_stage: Sequence[int] | None = None,
    layout: str = "loop",
) -> list[Bounds]:
    """Per-rank chunk ranges of a list of layers: ``layers_per_stage`` when given (one count per
    stage, in data-flow order), otherwise ``method`` (``uniform`` by layers, ``balanced`` by
    parameter count).

    Raises:
        ValueError: an unknown method, or counts that do not fit the model.
    """
    n = len(layers)
    stages = _stages(pipeline_size, num_chunks, layout, n)
    if layers_per_stage is not None:
        if len(layers_per_stage) != stages:
            raise ValueError(
                f"layers_per_stage has {len(layers_per_stage)} entries for {stages} stages; give "
                "one count per stage (pipeline size x chunks)."
            )
        bounds = bounds_from_counts(layers_per_stage, n)
    elif method == "uniform":
        bounds = chunked_uniform_bounds(n, pipeline_size, num_chunks)
    elif method == "balanced":
        weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        bounds = balanced_bounds(weights, stages)
    else:
        raise ValueError(f"method={method!r} is unknown; choose one of {METHODS}.")
    return per_rank(bounds, pipeline_size, num_chunks, layout)
