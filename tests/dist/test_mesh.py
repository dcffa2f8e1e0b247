"""ProcessGroupMesh on real process groups: coordinates, per-axis groups, collectives in them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from kolossos.cluster import ProcessGroupMesh, mesh_math
from kolossos.testing import distributed


def _check_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = ProcessGroupMesh(*shape, axis_names=names)
    rank = dist.get_rank()
    assert mesh.coordinate() == mesh_math.unravel(rank, shape)
    assert mesh.size() == shape
    for axis, name in enumerate(names):
        assert mesh.coordinate(name) == mesh.coordinate(axis) == mesh.coordinate_of(rank)[axis]
        group = mesh.get_group_along_axis(name)
        expected = mesh.ranks_along_axis(axis)
        assert mesh.get_ranks_in_group(group) == expected
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(expected)
    both = tuple(dict.fromkeys((names[0], names[-1])))
    group = mesh.get_group_along_axis(both)
    assert mesh.get_ranks_in_group(group) == mesh.ranks_along_axis(both)
    assert mesh.device_mesh.mesh.shape == torch.Size(shape)


@pytest.mark.parametrize(
    ("shape", "names"),
    [((2, 2), ("dp", "tp")), ((2, 1, 2), ("dp", "pp", "tp")), ((4,), ("dp",))],
)
@distributed(4)
def test_mesh_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    assert math.prod(shape) == 4
    _check_mesh(shape, names)


@distributed(2)
def test_mesh_bad_input() -> None:
    with pytest.raises(ValueError, match="world size is 2"):
        ProcessGroupMesh(2, 2)
    with pytest.raises(ValueError, match="axis_names"):
        ProcessGroupMesh(2, axis_names=("a", "b"))
    mesh = ProcessGroupMesh(1, 2, axis_names=("pp", "tp"))
    with pytest.raises(ValueError, match="unknown mesh axis 'dp'"):
        mesh.get_group_along_axis("dp")
    assert "pp=1, tp=2" in repr(mesh)
