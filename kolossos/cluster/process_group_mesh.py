"""``ProcessGroupMesh``: the processes of a job on named axes, with a process group per axis
(or per set of axes), built over :class:`torch.distributed.device_mesh.DeviceMesh`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kolossos.accelerator import get_accelerator
from kolossos.cluster import mesh_math

AxisLike = int | str
AxesLike = AxisLike | Sequence[AxisLike]


class ProcessGroupMesh:
    """A mesh of all processes with shape ``size`` (row-major: rank = ravel(coordinate)).

    ``ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))`` puts ranks ``[[0, 1], [2, 3]]`` on a grid;
    ``get_group_along_axis("tp")`` is ``{0, 1}`` on ranks 0 and 1 and ``{2, 3}`` on ranks 2 and 3.
    Groups along one axis come from the underlying ``DeviceMesh``; groups along several axes are
    created on first request (every rank must request them in the same order, as with any
    ``new_group``) and cached.

    Args:
        *size: the size of each axis; their product must equal the world size.
        axis_names: optional unique names, one per axis (default ``axis0``, ``axis1``, ...).
        device_type: device type of the ``DeviceMesh`` (default: the accelerator's).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a bad size, names that do not match the axes, or a product that is not the world
            size.

    Example:
        >>> mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))  # doctest: +SKIP
        >>> mesh.coordinate()  # on rank 3  # doctest: +SKIP
        (1, 1)
    """

    def __init__(
        self,
        *size: int,
        axis_names: Sequence[str] | None = None,
        device_type: str | None = None,
    ) -> None:
        shape = mesh_math.validate_shape(size)
        names = self._check_names(axis_names, len(shape))
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupMesh needs torch.distributed to be initialised; call "
                "kolossos.launch_from_torch() (or launch) first."
            )
        world = dist.get_world_size()
        if math.prod(shape) != world:
            raise ValueError(
                f"mesh {shape} holds {math.prod(shape)} processes but the world size is {world}; "
                "choose axis sizes whose product is the number of processes."
            )
        if device_type is None:
            device_type = get_accelerator().name
        self._shape = shape
        self._names = names
        self._rank = dist.get_rank()
        self._coord = mesh_math.unravel(self._rank, shape)
        self._device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}

    unravel = staticmethod(mesh_math.unravel)
    ravel = staticmethod(mesh_math.ravel)

    @staticmethod
    def _check_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...]:
        if names is None:
            return tuple(f"axis{i}" for i in range(ndim))
        out = tuple(names)
        if len(out) != ndim or len(set(out)) != ndim or not all(isinstance(n, str) for n in out):
            raise ValueError(
                f"axis_names={out!r} must be {ndim} distinct strings, one per mesh axis."
            )
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        """The size of each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The name of each axis."""
        return self._names

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def device_mesh(self) -> DeviceMesh:
        """The underlying ``DeviceMesh`` (for DTensor, FSDP2, tensor-parallel styles)."""
        return self._device_mesh

    def axis_index(self, axis: AxisLike) -> int:
        """The index of an axis given by index or name."""
        if isinstance(axis, str):
            if axis not in self._names:
                raise ValueError(f"unknown mesh axis {axis!r}; the axes are {self._names}.")
            return self._names.index(axis)
        return mesh_math.normalize_axes(axis, len(self._shape))[0]

    def _axes(self, axes: AxesLike) -> tuple[int, ...]:
        items = [axes] if isinstance(axes, (int, str)) else list(axes)
        return mesh_math.normalize_axes([self.axis_index(a) for a in items], len(self._shape))

    def size(self, axis: AxisLike | None = None) -> int | tuple[int, ...]:
        """The size of one axis, or the whole shape when ``axis`` is ``None``."""
        return self._shape if axis is None else self._shape[self.axis_index(axis)]

    def coordinate(self, axis: AxisLike | None = None) -> int | tuple[int, ...]:
        """This rank's coordinate on one axis, or all of them when ``axis`` is ``None``."""
        return self._coord if axis is None else self._coord[self.axis_index(axis)]

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        """The coordinate of any rank."""
        return mesh_math.unravel(rank, self._shape)

    def rank_at(self, coord: Sequence[int]) -> int:
        """The rank at a coordinate."""
        return mesh_math.ravel(coord, self._shape)

    def ranks_along_axis(self, axes: AxesLike) -> list[int]:
        """The global ranks of this rank's group along ``axes`` (ascending)."""
        return mesh_math.group_ranks(self._coord, self._shape, self._axes(axes))

    def get_group_along_axis(self, axes: AxesLike) -> ProcessGroup:
        """The process group of this rank along one axis or several axes.

        Args:
            axes: an axis (index or name) or a sequence of them.
        """
        key = self._axes(axes)
        group = self._groups.get(key)
        if group is None:
            if len(key) == 1:
                group = self._device_mesh.get_group(key[0])
            elif len(key) == len(self._shape):
                group = dist.group.WORLD
                assert group is not None
            else:
                # SYNC POINT: new_group is collective; every rank creates every group, same order.
                group, _ = dist.new_subgroups_by_enumeration(mesh_math.all_groups(self._shape, key))
            self._groups[key] = group
        return group

    def get_ranks_in_group(self, group: ProcessGroup) -> list[int]:
        """The global ranks of a process group, in group-rank order."""
        return dist.get_process_group_ranks(group)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._shape, strict=True))
        return f"ProcessGroupMesh({axes}; rank {self._rank} at {self._coord})"
