"""3D tensor parallelism: the cube arithmetic, the group layout and the errors raised before any
process group exists (sizes that are not cubes, features not divisible, bad arguments)."""

from __future__ import annotations

import pytest
import torch

from kolossos.legacy.context.process_group_initializer import layouts
from kolossos.legacy.nn.layer import parallel_3d as facade
from kolossos.nn.layer.parallel_3d import (
    CrossEntropyLoss3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    build_groups_3d,
    check_cube,
    cube_rank_lists,
    divide_3d,
)
from kolossos.nn.layer.shard_layout import get_shard_layout


@pytest.mark.parametrize(("size", "edge"), [(1, 1), (8, 2), (27, 3), (64, 4), (1000, 10)])
def test_check_cube_accepts_cubes(size: int, edge: int) -> None:
    assert check_cube(size) == edge


@pytest.mark.parametrize("size", [0, -8, 2, 4, 9, 26, 63, True, 8.0])
def test_check_cube_rejects_other_sizes(size: object) -> None:
    with pytest.raises(ValueError, match="3D tensor parallelism"):
        check_cube(size)  # type: ignore[arg-type]


def test_divide_3d_names_the_value_and_the_rule() -> None:
    assert divide_3d(1024, 4, "out_features") == 256
    with pytest.raises(ValueError, match=r"out_features=1022 must be a positive multiple of 4"):
        divide_3d(1022, 4, "out_features")
    with pytest.raises(ValueError, match="in_features=0"):
        divide_3d(0, 2, "in_features")


@pytest.mark.parametrize(("world", "tensor"), [(8, 8), (16, 8), (27, 27)])
def test_cube_layout_is_the_legacy_initializers(world: int, tensor: int) -> None:
    """The core groups and the legacy ``PARALLEL_3D_*`` groups hold the same ranks."""
    lists = cube_rank_lists(world, tensor)
    legacy = layouts.groups_3d(world, tensor)
    roles = ("input", "weight", "output", "input_x_weight", "output_x_weight")
    for role, groups in zip(roles, legacy, strict=True):
        assert lists[role] == groups, role
    assert lists["tensor"] == layouts.tensor_groups(world, tensor)


def test_cube_layout_roles() -> None:
    """Each line of the cube holds q ranks, each plane q**2, every rank is in exactly one group
    of each role, and the three lines through a rank meet only there."""
    lists = cube_rank_lists(27, 27)
    for role, groups in lists.items():
        expected = {"tensor": 27, "input_x_weight": 9, "output_x_weight": 9}.get(role, 3)
        assert all(len(g) == expected for g in groups), role
        assert sorted(r for g in groups for r in g) == list(range(27)), role
    for rank in range(27):
        roles = ("input", "weight", "output")
        lines = [next(g for g in lists[role] if rank in g) for role in roles]
        assert set(lines[0]) & set(lines[1]) == set(lines[1]) & set(lines[2]) == {rank}


@pytest.mark.parametrize(("world", "tensor"), [(12, 8), (8, 4)])
def test_cube_layout_rejects_bad_sizes(world: int, tensor: int) -> None:
    with pytest.raises(ValueError, match="3D tensor parallelism"):
        cube_rank_lists(world, tensor)


def test_layers_need_groups3d() -> None:
    with pytest.raises(TypeError, match="must be a Groups3D"):
        Linear3D(8, 8, groups=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a Groups3D"):
        LayerNorm3D(8, groups="input")  # type: ignore[arg-type]


def test_unsupported_options_fail_before_any_collective() -> None:
    with pytest.raises(NotImplementedError, match="last dimension only"):
        LayerNorm3D((4, 8), groups=None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="not supported under 3D"):
        Embedding3D(10, 8, None, None, None, max_norm=1.0, groups=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="by keyword"):
        CrossEntropyLoss3D(True, torch.ones(3), groups=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown option"):
        CrossEntropyLoss3D(size_average=True, groups=None)  # type: ignore[arg-type]


def test_without_a_launch() -> None:
    with pytest.raises(RuntimeError, match=r"kolossos\.launch"):
        build_groups_3d()
    with pytest.raises(RuntimeError, match="mode='3d'"):
        facade.Linear3D(256, 1024)
    assert get_shard_layout(torch.zeros(2)) is None
