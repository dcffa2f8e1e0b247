"""``DeviceMesh``: Colossal-AI's logical view of a set of devices
(``colossalai.device.device_mesh``).

A physical list of global ranks (``physical_mesh_id``) is viewed as an N-dimensional logical
mesh (``logical_mesh_id``, row-major: the last axis varies fastest). Along each axis, the ranks
that differ only in that axis's coordinate form one process group. The groups are ordinary
``torch.distributed`` groups, created in one fixed order on every rank; for DTensor or FSDP2,
use :class:`kolossos.cluster.ProcessGroupMesh`, which wraps torch's own ``DeviceMesh``.

The alpha-beta cost model (``mesh_alpha`` latency and ``mesh_beta`` inverse bandwidth per axis)
is Colossal-AI's, for its auto-parallel search.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

from kolossos.accelerator import get_accelerator

__all__ = ["DeviceMesh"]

#: the ``torch.distributed`` backend of each device type
DIST_BACKEND = {"cuda": "nccl", "cpu": "gloo", "npu": "hccl"}

MeshShape = torch.Size | tuple[int, ...] | list[int]


def _check_ids(physical: torch.Tensor, logical: torch.Tensor) -> None:
    if physical.dim() != 1:
        raise ValueError(
            f"DeviceMesh: physical_mesh_id must be a 1D tensor of global ranks, got shape "
            f"{tuple(physical.shape)}; pass e.g. torch.arange(world_size)."
        )
    if torch.unique(physical).numel() != physical.numel():
        raise ValueError(f"DeviceMesh: physical_mesh_id {physical.tolist()} repeats a rank.")
    if not torch.equal(torch.unique(physical), torch.unique(logical)):
        raise ValueError(
            f"DeviceMesh: logical_mesh_id {logical.tolist()} and physical_mesh_id "
            f"{physical.tolist()} must hold the same ranks, each once."
        )


class DeviceMesh:
    """A logical N-dimensional view of a list of global ranks, with a process group per axis.

    Give either ``mesh_shape`` (``physical_mesh_id`` is reshaped to it) or ``logical_mesh_id``.

    Args:
        physical_mesh_id: 1D tensor of the global ranks in the mesh.
        mesh_shape: shape of the logical mesh (its product is the number of ranks).
        logical_mesh_id: the logical mesh itself (a permutation of ``physical_mesh_id``).
        mesh_alpha: latency coefficient per axis of the cost model (default 1 each).
        mesh_beta: inverse-bandwidth coefficient per axis of the cost model (default 1 each).
        init_process_group: create the process groups now (a collective over the default
            group: every rank must construct the mesh); else call
            :meth:`init_logical_process_group` later.
        device: ``"cuda"``, ``"cpu"`` or ``"npu"``, which picks the groups' backend (``nccl``,
            ``gloo``, ``hccl``); ``None`` (Colossal-AI: ``"cuda"``): the accelerator's device.

    Raises:
        ValueError: both or neither of ``mesh_shape`` / ``logical_mesh_id``, a shape whose
            product differs from the number of ranks, repeated ranks, or cost coefficients
            whose lengths differ.

    Example:
        >>> mesh = DeviceMesh(torch.arange(4), (2, 2))
        >>> mesh.global_rank_to_local_rank(3)
        [1, 1]
        >>> mesh.get_ranks_in_process_group(axis=0, global_rank=1)
        [1, 3]
    """

    def __init__(
        self,
        physical_mesh_id: torch.Tensor,
        mesh_shape: MeshShape | None = None,
        logical_mesh_id: torch.Tensor | None = None,
        mesh_alpha: Sequence[float] | None = None,
        mesh_beta: Sequence[float] | None = None,
        init_process_group: bool = False,
        device: str | None = None,
    ) -> None:
        if (mesh_shape is None) == (logical_mesh_id is None):
            raise ValueError(
                "DeviceMesh needs exactly one of mesh_shape and logical_mesh_id (got "
                f"mesh_shape={mesh_shape!r}, logical_mesh_id={logical_mesh_id!r})."
            )
        self._physical_mesh_id: torch.Tensor | None = physical_mesh_id
        if logical_mesh_id is None:
            assert mesh_shape is not None
            if math.prod(mesh_shape) != physical_mesh_id.numel():
                raise ValueError(
                    f"DeviceMesh: mesh_shape {tuple(mesh_shape)} holds {math.prod(mesh_shape)} "
                    f"devices but physical_mesh_id has {physical_mesh_id.numel()}."
                )
            self._mesh_shape: MeshShape = mesh_shape
            self._logical_mesh_id: torch.Tensor | None = physical_mesh_id.reshape(tuple(mesh_shape))
        else:
            self._mesh_shape = logical_mesh_id.shape
            self._logical_mesh_id = logical_mesh_id
        assert self._logical_mesh_id is not None
        _check_ids(physical_mesh_id, self._logical_mesh_id)
        ndim = len(self._mesh_shape)
        self.mesh_alpha = tuple(mesh_alpha) if mesh_alpha is not None else (1.0,) * ndim
        self.mesh_beta = tuple(mesh_beta) if mesh_beta is not None else (1.0,) * ndim
        if len(self.mesh_alpha) != len(self.mesh_beta):
            raise ValueError(
                f"DeviceMesh: mesh_alpha {self.mesh_alpha} and mesh_beta {self.mesh_beta} "
                "must have one entry per axis each."
            )
        self._device = device if device is not None else get_accelerator().name
        if self._device not in DIST_BACKEND:
            raise ValueError(
                f"DeviceMesh(device={device!r}) is not supported; pass one of "
                f"{sorted(DIST_BACKEND)} (or None for the accelerator's device)."
            )
        self._dist_backend = DIST_BACKEND[self._device]
        #: global rank -> its coordinate (local rank along each axis)
        self._global_to_local_rank_mapping = self._coordinates(self._logical_mesh_id)
        #: global rank -> axis -> the global ranks of its group along that axis
        self._ranks_in_the_process_group = self._groups_of_ranks(self._logical_mesh_id)
        #: global rank -> axis -> process group (this rank's groups, and handles of the others)
        self._process_group_dict: dict[int, dict[int, ProcessGroup]] = {}
        self._global_rank_of_current_process: int | None = None
        self._is_initialized = False
        self._is_init_from_process_group = False
        self._init_process_group = init_process_group
        self._torch_mesh: TorchDeviceMesh | None = None
        if init_process_group:
            self.init_logical_process_group()

    @staticmethod
    def _coordinates(logical: torch.Tensor) -> dict[int, list[int]]:
        ranks = logical.reshape(-1).tolist()
        coords = torch.cartesian_prod(*(torch.arange(n) for n in logical.shape))
        coords = coords.reshape(len(ranks), logical.dim())
        return {int(r): [int(c) for c in coord] for r, coord in zip(ranks, coords, strict=True)}

    @staticmethod
    def _groups_of_ranks(logical: torch.Tensor) -> dict[int, dict[int, list[int]]]:
        out: dict[int, dict[int, list[int]]] = {int(r): {} for r in logical.reshape(-1).tolist()}
        for axis in range(logical.dim()):
            rows = logical.movedim(axis, -1).reshape(-1, logical.shape[axis]).tolist()
            for row in rows:
                for rank in row:
                    out[rank][axis] = [int(r) for r in row]
        return out

    # ---- properties --------------------------------------------------------------------------

    @property
    def shape(self) -> MeshShape:
        """The logical mesh's shape, as given (``mesh_shape``, or ``logical_mesh_id.shape``)."""
        return self._mesh_shape

    @property
    def num_devices(self) -> int:
        """The number of devices (ranks) in the mesh."""
        return math.prod(self._mesh_shape)

    @property
    def logical_mesh_id(self) -> torch.Tensor | None:
        """The logical mesh of global ranks (``None`` for :meth:`from_process_group` meshes)."""
        return self._logical_mesh_id

    @property
    def device_type(self) -> str:
        """``"cuda"``, ``"cpu"`` or ``"npu"``: the device type of the mesh's groups."""
        return self._device

    def get_torch_mesh(self) -> TorchDeviceMesh:
        """The same logical mesh as a torch ``DeviceMesh`` (for DTensor), made on first call
        and kept (COLLECTIVE on first call: every rank calls it, in the same order).

        Raises:
            RuntimeError: no ``torch.distributed``, or a :meth:`from_process_group` mesh of
                several groups.
        """
        if self._torch_mesh is None and self._is_init_from_process_group:
            groups = self._process_group_dict[self._rank_or_current(None, "get_torch_mesh")]
            if len(groups) != 1:
                raise RuntimeError(
                    "DeviceMesh.get_torch_mesh: a from_process_group mesh of several groups does "
                    "not know the global layout; build it from physical ids instead."
                )
            self._torch_mesh = TorchDeviceMesh.from_group(groups[0], self._device)
        if self._torch_mesh is None:
            if self._logical_mesh_id is None or not dist.is_initialized():
                raise RuntimeError(
                    "DeviceMesh.get_torch_mesh needs the global layout and torch.distributed; "
                    "build the mesh from physical ids after kolossos.launch(...)."
                )
            self._torch_mesh = TorchDeviceMesh(self._device, self._logical_mesh_id)
        return self._torch_mesh

    @property
    def is_initialized(self) -> bool:
        """Whether the process groups exist."""
        return self._is_initialized

    @property
    def process_groups_dict(self) -> dict[int, dict[int, ProcessGroup]]:
        """Global rank -> axis -> process group (empty until the groups exist)."""
        return self._process_group_dict

    # ---- process groups ----------------------------------------------------------------------

    def init_logical_process_group(self) -> None:
        """Create the process groups of every axis (COLLECTIVE over the default group: every rank
        calls it, members of the mesh or not, since ``torch.distributed.new_group`` is).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised, or the groups exist already.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "DeviceMesh.init_logical_process_group needs torch.distributed; call "
                "kolossos.launch(...) (or launch_from_torch) first."
            )
        if self._is_initialized:
            raise RuntimeError("DeviceMesh: the process groups exist already; create them once.")
        self._global_rank_of_current_process = dist.get_rank()
        created: dict[tuple[int, ...], ProcessGroup] = {}
        for axis in range(len(self._mesh_shape)):
            # the same order on every rank: axis by axis, groups in the order of their ranks
            groups = sorted({tuple(g[axis]) for g in self._ranks_in_the_process_group.values()})
            for ranks in groups:
                if ranks not in created:  # one group per set of ranks (a 1-sized axis repeats)
                    created[ranks] = dist.new_group(list(ranks), backend=self._dist_backend)
                for rank in ranks:
                    self._process_group_dict.setdefault(rank, {})[axis] = created[ranks]
        self._is_initialized = True

    def _rank_or_current(self, global_rank: int | None, method: str) -> int:
        if global_rank is not None and self._is_init_from_process_group:
            raise RuntimeError(
                f"DeviceMesh.{method}(global_rank=...) is not available on a mesh made by "
                "DeviceMesh.from_process_group, which knows only this process's groups; call it "
                "without global_rank."
            )
        rank = global_rank if global_rank is not None else self._global_rank_of_current_process
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else None
        if rank is None:
            raise RuntimeError(f"DeviceMesh.{method}: pass global_rank (no process group yet).")
        return rank

    def get_process_group(self, axis: int, global_rank: int | None = None) -> ProcessGroup:
        """The process group along ``axis`` of ``global_rank`` (default: this process).

        Raises:
            RuntimeError: the groups do not exist yet (see ``init_process_group``).
            KeyError: the rank is not in the mesh, or ``axis`` is not an axis of it.
        """
        return self.get_process_group_for_all_axes(global_rank)[axis]

    def get_process_group_for_all_axes(self, global_rank: int | None = None) -> dict[int, Any]:
        """Axis -> process group of ``global_rank`` (default: this process)."""
        rank = self._rank_or_current(global_rank, "get_process_group_for_all_axes")
        if not self._is_initialized:
            raise RuntimeError(
                "DeviceMesh: the process groups do not exist yet; pass init_process_group=True "
                "or call init_logical_process_group() on every rank."
            )
        if rank not in self._process_group_dict:
            raise KeyError(f"global rank {rank} is not in this DeviceMesh")
        return self._process_group_dict[rank]

    def get_ranks_in_process_group(self, axis: int, global_rank: int | None = None) -> list[int]:
        """The global ranks of ``global_rank``'s group along ``axis`` (default: this process)."""
        rank = self._rank_or_current(global_rank, "get_ranks_in_process_group")
        if self._is_init_from_process_group:
            return dist.get_process_group_ranks(self.get_process_group(axis))
        if rank not in self._ranks_in_the_process_group:
            raise KeyError(f"global rank {rank} is not in this DeviceMesh")
        return list(self._ranks_in_the_process_group[rank][axis])

    def global_rank_to_local_rank(self, rank: int, axis: int | None = None) -> list[int] | int:
        """The coordinate of global ``rank`` in the logical mesh, or its local rank along
        ``axis`` (Colossal-AI returns the whole coordinate for ``axis=0``; here an int)."""
        if self._is_init_from_process_group:
            raise RuntimeError(
                "DeviceMesh.global_rank_to_local_rank is not available on a mesh made by "
                "DeviceMesh.from_process_group (it does not know the global layout)."
            )
        if rank not in self._global_to_local_rank_mapping:
            raise KeyError(f"global rank {rank} is not in this DeviceMesh")
        coord = self._global_to_local_rank_mapping[rank]
        return list(coord) if axis is None else coord[axis]

    @staticmethod
    def from_process_group(process_group: ProcessGroup | list[ProcessGroup]) -> DeviceMesh:
        """A mesh whose axis ``i`` is the ``i``-th given group of this process. It knows only
        this process's groups: queries about other global ranks raise ``RuntimeError``.

        Raises:
            ValueError: the groups have different backends.
        """
        groups = [process_group] if isinstance(process_group, ProcessGroup) else process_group
        backends = {str(dist.get_backend(g)) for g in groups}
        devices = [d for d, b in DIST_BACKEND.items() if b in backends]
        if len(backends) != 1 or not devices:
            raise ValueError(
                f"DeviceMesh.from_process_group: the groups' backends {sorted(backends)} must be "
                f"one of {sorted(DIST_BACKEND.values())}, the same for every group."
            )
        shape = [dist.get_world_size(g) for g in groups]
        mesh = DeviceMesh(torch.arange(math.prod(shape)), shape, device=devices[0])
        rank = dist.get_rank()
        mesh._physical_mesh_id = None
        mesh._logical_mesh_id = None
        mesh._global_to_local_rank_mapping = {}
        mesh._ranks_in_the_process_group = {}
        mesh._global_rank_of_current_process = rank
        mesh._process_group_dict = {rank: dict(enumerate(groups))}
        mesh._is_initialized = True
        mesh._is_init_from_process_group = True
        return mesh

    def flatten(self) -> DeviceMesh:
        """The same ranks as a 1D mesh (cost coefficients: the largest of the axes')."""
        if self._physical_mesh_id is None:
            raise RuntimeError("DeviceMesh.flatten is not available on a from_process_group mesh.")
        return DeviceMesh(
            self._physical_mesh_id,
            (self.num_devices,),
            mesh_alpha=[max(self.mesh_alpha)],
            mesh_beta=[max(self.mesh_beta)],
            init_process_group=self._init_process_group,
            device=self._device,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceMesh:
        # process groups cannot be copied: the copy shares them
        result = type(self).__new__(type(self))
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            shared = key in ("_process_group_dict", "_torch_mesh")
            setattr(result, key, value if shared else copy.deepcopy(value, memo))
        return result

    # ---- alpha-beta cost model (Colossal-AI's, for its auto-parallel search) -----------------

    def _cost(self, num_bytes: float, mesh_dim: int, volume: float, tie: float) -> float:
        return self.mesh_alpha[mesh_dim] + self.mesh_beta[mesh_dim] * volume * num_bytes + tie

    def all_gather_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """Modelled time of an all-gather of ``num_bytes`` along ``mesh_dim``."""
        n = self.shape[mesh_dim]
        return self._cost(num_bytes, mesh_dim, (n - 1) / n, 0.1)

    def all_reduce_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """Modelled time of an all-reduce of ``num_bytes`` along ``mesh_dim``."""
        n = self.shape[mesh_dim]
        return self._cost(num_bytes, mesh_dim, 2 * (n - 1) / n, 0.01)

    def reduce_scatter_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """Modelled time of a reduce-scatter of ``num_bytes`` along ``mesh_dim``."""
        n = self.shape[mesh_dim]
        return self._cost(num_bytes, mesh_dim, (n - 1) / n, 0.001)

    def all_to_all_cost(self, num_bytes: float, mesh_dim: int) -> float:
        """Modelled time of an all-to-all of ``num_bytes`` along ``mesh_dim``."""
        n = self.shape[mesh_dim]
        return self._cost(num_bytes, mesh_dim, (n - 1) / n / n * (n / 2.0), 0.001)

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={tuple(self._mesh_shape)}, device={self._device!r})"
