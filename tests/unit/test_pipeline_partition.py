"""Stage layouts and partitioning (pure functions), and build_pipeline_model in one process."""

from __future__ import annotations

import itertools
import random

import pytest
import torch.nn as nn

from kolossos.pipeline import build_pipeline_model, partition_balanced, partition_uniform
from kolossos.pipeline.layout import owner_of, stage_of
from kolossos.pipeline.partition import balanced_bounds, partition_layers, uniform_bounds


def test_partition_uniform_matches_the_docs() -> None:
    assert partition_uniform(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    parts = partition_uniform(10, 4)
    assert parts == [[(0, 2)], [(2, 4)], [(4, 7)], [(7, 10)]]  # the last stages take the rest
    assert parts[0][0][0] == 0 and parts[-1][0][1] == 10  # start 0: first; end n: last
    assert partition_uniform(8, 2, 2, layout="v") == [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]
    with pytest.raises(ValueError, match="cannot fill 8 stages"):
        partition_uniform(7, 4, 2)
    with pytest.raises(ValueError, match="exactly 2 model chunks"):
        partition_uniform(9, 3, 3, layout="v")


def test_uniform_bounds_cover_every_layer_once() -> None:
    for n, s in itertools.product(range(1, 20), range(1, 8)):
        if n < s:
            continue
        bounds = uniform_bounds(n, s)
        assert [a for a, _ in bounds[1:]] == [b for _, b in bounds[:-1]]
        sizes = [b - a for a, b in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == n and max(sizes) - min(sizes) <= 1


def test_balanced_bounds_are_optimal() -> None:
    assert balanced_bounds([1, 1, 1, 10], 2) == [(0, 3), (3, 4)]
    assert balanced_bounds([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    rng = random.Random(0)
    for _ in range(200):
        n, s = rng.randint(1, 9), rng.randint(1, 4)
        if n < s:
            continue
        weights = [rng.randint(0, 20) for _ in range(n)]
        best = min(
            max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, n), strict=True))
            for cuts in itertools.combinations(range(1, n), s - 1)
        )
        got = balanced_bounds(weights, s)
        assert max(sum(weights[a:b]) for a, b in got) == best
        assert all(b > a for a, b in got)


def test_partition_by_parameters_and_explicit_counts() -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 64), nn.Linear(64, 4), nn.ReLU()]
    weights = [sum(p.numel() for p in m.parameters()) for m in layers]
    assert partition_layers(layers, 2, method="balanced") == partition_balanced(weights, 2)
    assert partition_layers(layers, 2, method="balanced") == [[(0, 2)], [(2, 4)]]
    assert partition_layers(layers, 2, layers_per_stage=[1, 3]) == [[(0, 1)], [(1, 4)]]
    with pytest.raises(ValueError, match="sum to the 4 layers"):
        partition_layers(layers, 2, layers_per_stage=[1, 2])
    with pytest.raises(ValueError, match="one count per stage"):
        partition_layers(layers, 2, layers_per_stage=[4])
    with pytest.raises(ValueError, match="method='greedy' is unknown"):
        partition_layers(layers, 2, method="greedy")


def test_layouts_round_trip() -> None:
    for p, v, layout in [(4, 1, "loop"), (4, 3, "loop"), (4, 2, "v"), (1, 2, "v")]:
        seen = set()
        for r, c in itertools.product(range(p), range(v)):
            s = stage_of(r, c, p, v, layout)
            assert owner_of(s, p, v, layout) == (r, c)
            seen.add(s)
        assert seen == set(range(p * v))
    assert [stage_of(r, 1, 4, 2, "v") for r in range(4)] == [7, 6, 5, 4]
    with pytest.raises(ValueError, match="unknown"):
        stage_of(0, 0, 2, 1, "zigzag")


def test_build_pipeline_model_in_one_process_keeps_names() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    stage = build_pipeline_model(model, num_chunks=1, verbose=True)
    assert isinstance(stage, nn.Sequential) and list(stage.state_dict()) == list(model.state_dict())
    chunks = build_pipeline_model(list(model), num_chunks=3)
    assert isinstance(chunks, nn.ModuleList) and [len(c) for c in chunks] == [1, 1, 1]
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        build_pipeline_model(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_stage_manager_layer_helpers_without_a_process_group() -> None:
    from kolossos.pipeline.stage_manager import PipelineStageManager, _SingleProcess

    sm = PipelineStageManager.default(num_model_chunks=2)
    assert isinstance(sm, _SingleProcess) and sm.is_first_stage(0) and sm.is_last_stage(1)
    assert sm.distribute_layers(5) == [2, 3]
    assert sm.get_stage_index([2, 3]) == [(0, 2), (2, 5)]
    with pytest.raises(ValueError, match="one count per stage"):
        sm.get_stage_index([5])
    with pytest.raises(ValueError, match="cannot fill 2"):
        sm.distribute_layers(1)
