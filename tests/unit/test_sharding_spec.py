"""The sharding-spec notation and the layout converter's greedy search, on a fake 2 x 2 mesh
(no process group): the docs' worked conversion paths and one-step candidate sets, the
similarity function, layouts, and the cost model."""

from __future__ import annotations

import itertools

import pytest
import torch

from kolossos.device.device_mesh import DeviceMesh
from kolossos.tensor.comm_spec import CollectiveCommPattern
from kolossos.tensor.d_tensor import Layout, LayoutConverter, ShardingSpec
from kolossos.tensor.sharding_spec import dim_difference, merge_same_dim_mesh_list

MESH = DeviceMesh(torch.arange(4), (2, 2), device="cpu")
SHAPE = (4, 4, 4)


def layout(notation: str, shape: tuple[int, ...] = SHAPE) -> Layout:
    return Layout(MESH, ShardingSpec.from_notation(notation), shape)


def names(candidates: dict[Layout, object]) -> set[str]:
    return {str(c.sharding_spec) for c in candidates}


def test_notation_round_trips() -> None:
    for text in ["RRR", "S0RR", "RS01R", "S1S0R", "RRS1"]:
        assert str(ShardingSpec.from_notation(text)) == text
    assert ShardingSpec.from_notation("S_{01}RR") == ShardingSpec(3, {0: [0, 1]})
    assert ShardingSpec.from_notation("[S0, R, S1]").dim_partition_dict == {0: [0], 2: [1]}
    assert ShardingSpec(2, {-1: [1]}).sharding_sequence == ["R", "S1"]
    assert merge_same_dim_mesh_list(3, {-1: [0], 2: [1]}) == {2: [0, 1]}


@pytest.mark.parametrize(
    ("bad", "match"),
    [("S0X", "cannot read"), ("S0S0", "at most one"), ("", None)],
)
def test_notation_errors(bad: str, match: str | None) -> None:
    if match is None:
        assert ShardingSpec.from_notation(bad).dims == 0
        return
    with pytest.raises(ValueError, match=match):
        ShardingSpec.from_notation(bad)


def test_similarity_function() -> None:
    table = [
        ([], [], 0),
        ([0], [], 20),  # one all-gather
        ([], [0], 5),  # one shard
        ([0], [1], 31),  # gather, then shard
        ([], [0, 1], 16),
        ([0, 1], [], 46),
        ([1], [0, 1], 42),
        ([0, 1], [1], 57),
        ([0], [0, 1], 5),
    ]
    for src, dst, cost in table:
        assert dim_difference(src, dst) == cost, (src, dst)
    a, b = ShardingSpec.from_notation("S01RR"), ShardingSpec.from_notation("RS01R")
    assert a.spec_diff(b) == 46 + 16 and a.spec_diff(a) == 0


def test_documented_one_step_candidates() -> None:
    """The docs' table (F0:735-743): all-gather / shard / all-to-all sets per source."""
    lc = LayoutConverter()
    src = layout("S01RR")
    assert names(lc.all_gather_transform_layouts(src)) == {"S0RR"}
    assert names(lc.shard_transform_layout(src)) == set()
    assert names(lc.all_to_all_transform_layout(src)) == {"S0RS1", "S0S1R"}
    src = layout("S0RR")
    assert names(lc.all_gather_transform_layouts(src)) == {"RRR"}
    # the docs list S0S1R, S0RS1; the same rule that gives RS01R from RS0R (row 3) gives S01RR
    assert names(lc.shard_transform_layout(src)) == {"S0S1R", "S0RS1", "S01RR"}
    assert names(lc.all_to_all_transform_layout(src)) == {"RS0R", "RRS0"}
    src = layout("RS0R")
    assert names(lc.all_gather_transform_layouts(src)) == {"RRR"}
    assert names(lc.shard_transform_layout(src)) == {"RS01R", "S1S0R", "RS0S1"}
    assert names(lc.all_to_all_transform_layout(src)) == {"S0RR", "RRS0"}


@pytest.mark.parametrize(
    ("source", "path"),
    [
        ("S01RR", ["S0RR", "RS0R", "RS01R"]),
        ("S0RR", ["RS0R", "RS01R"]),
        ("RS0R", ["RS01R"]),
    ],
)
def test_documented_conversion_paths(source: str, path: list[str]) -> None:
    found, steps = LayoutConverter().layout_converting(layout(source), layout("RS01R"))
    assert [str(x.sharding_spec) for x in found] == [source, *path]
    assert len(steps) == len(path)


def test_documented_steps_are_the_documented_collectives() -> None:
    _, steps = LayoutConverter().layout_converting(layout("S01RR"), layout("RS01R"))
    assert [s.comm_pattern for s in steps] == [
        CollectiveCommPattern.GATHER_FWD_SPLIT_BWD,  # S01RR -> S0RR
        CollectiveCommPattern.ALL2ALL_FWD_ALL2ALL_BWD,  # S0RR -> RS0R
        CollectiveCommPattern.SPLIT_FWD_GATHER_BWD,  # RS0R -> RS01R
    ]
    assert [s.logical_process_axis for s in steps] == [1, 0, 1]


def test_every_pair_on_a_2x2_mesh_has_a_path_of_single_steps() -> None:
    lc = LayoutConverter()
    specs = {
        str(ShardingSpec(3, {d: [a] for a, d in enumerate(assign) if d < 3}))
        for assign in itertools.product(range(4), repeat=2)
    }
    specs |= {"S01RR", "RS01R", "RRS01"}
    assert len(specs) == 16
    for src, dst in itertools.product(sorted(specs), sorted(specs)):
        path, steps = lc.layout_converting(layout(src), layout(dst))
        if src == dst:
            assert path == [] and steps == []
            continue
        assert str(path[0].sharding_spec) == src and str(path[-1].sharding_spec) == dst
        for before, after in itertools.pairwise(path):
            assert after in lc.get_all_one_step_transform_spec(before)
        assert len(steps) <= 4, (src, dst, [str(p.sharding_spec) for p in path])


def test_layout_shapes_and_errors() -> None:
    assert layout("S01RR", (8, 2, 2)).local_shape == (2, 2, 2)
    assert layout("S0S1R").local_shape == (2, 2, 4)
    with pytest.raises(ValueError, match="pieces"):
        layout("S01R", (6, 4))
    with pytest.raises(ValueError, match="mesh axes"):
        layout("S2R", (4, 4))
    with pytest.raises(ValueError, match="dimensions"):
        layout("S0R", (4, 4, 4))
    with pytest.raises(NotImplementedError, match="increasing"):
        layout("S10R", (4, 4)).placements()
    # shape not divisible by the pieces: the transform is skipped, not produced
    assert names(LayoutConverter().shard_transform_layout(layout("S0R", (4, 3)))) == {"S01R"}


def test_cost_model_follows_the_mesh_alpha_beta() -> None:
    mesh = DeviceMesh(
        torch.arange(4), (2, 2), mesh_alpha=[1.0, 2.0], mesh_beta=[0.1, 0.2], device="cpu"
    )
    lc = LayoutConverter()
    src = Layout(mesh, ShardingSpec.from_notation("S0R"), (4, 4))
    dst = Layout(mesh, ShardingSpec.from_notation("RR"), (4, 4))
    cost = lc.get_total_comm_cost(src, dst)
    # all-gather of 16 float32 = 64 output bytes along axis 0 moves half of them: 1 + 0.1 * 32
    assert cost["forward"] == pytest.approx(1.0 + 0.1 * 64 * 0.5)
    assert cost["backward"] == 0.0  # its backward is a local split
    back = lc.get_total_comm_cost(dst, src)  # a shard: free forward, all-gather backward
    assert back["forward"] == 0.0 and back["backward"] == pytest.approx(cost["forward"])
