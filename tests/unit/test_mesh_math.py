"""Mesh arithmetic: ranks ↔ coordinates and the groups along each axis."""

from __future__ import annotations

import itertools
import math

import pytest

from kolossos.cluster import mesh_math

SHAPES = [(2, 2), (2, 1, 2), (8,), (2, 3, 4)]


@pytest.mark.parametrize("shape", SHAPES)
def test_ravel_unravel_round_trip(shape: tuple[int, ...]) -> None:
    coords = [mesh_math.unravel(r, shape) for r in range(math.prod(shape))]
    assert coords == list(itertools.product(*(range(s) for s in shape)))  # row-major
    assert [mesh_math.ravel(c, shape) for c in coords] == list(range(math.prod(shape)))


def test_known_groups() -> None:
    # (2, 2): axis 0 groups by column, axis 1 by row
    assert mesh_math.all_groups((2, 2), (0,)) == [[0, 2], [1, 3]]
    assert mesh_math.all_groups((2, 2), (1,)) == [[0, 1], [2, 3]]
    assert mesh_math.all_groups((2, 2), (0, 1)) == [[0, 1, 2, 3]]
    # (2, 1, 2): the middle axis has size one, so its groups are singletons
    assert mesh_math.all_groups((2, 1, 2), (1,)) == [[0], [1], [2], [3]]
    assert mesh_math.all_groups((2, 1, 2), (0,)) == [[0, 2], [1, 3]]
    assert mesh_math.all_groups((2, 1, 2), (2,)) == [[0, 1], [2, 3]]
    assert mesh_math.all_groups((2, 1, 2), (0, 2)) == [[0, 1, 2, 3]]
    assert mesh_math.all_groups((8,), (0,)) == [list(range(8))]


@pytest.mark.parametrize("shape", SHAPES)
def test_groups_partition_the_world(shape: tuple[int, ...]) -> None:
    ndim = len(shape)
    for k in range(1, ndim + 1):
        for axes in itertools.combinations(range(ndim), k):
            groups = mesh_math.all_groups(shape, axes)
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(math.prod(shape)))
            assert all(len(g) == math.prod(shape[a] for a in axes) for g in groups)
            for rank in range(math.prod(shape)):
                mine = mesh_math.group_ranks(mesh_math.unravel(rank, shape), shape, axes)
                assert rank in mine and mine in groups


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="at least one axis"):
        mesh_math.validate_shape(())
    with pytest.raises(ValueError, match="size 0"):
        mesh_math.validate_shape((2, 0))
    with pytest.raises(ValueError, match="outside"):
        mesh_math.unravel(4, (2, 2))
    with pytest.raises(ValueError, match="outside"):
        mesh_math.ravel((0, 2), (2, 2))
    with pytest.raises(ValueError, match="out of range"):
        mesh_math.normalize_axes(3, 2)
    with pytest.raises(ValueError, match="same axis twice"):
        mesh_math.normalize_axes((0, -2), 2)
    assert mesh_math.normalize_axes((1, 0), 2) == (0, 1)
    assert mesh_math.normalize_axes(-1, 3) == (2,)
