"""The device mesh :func:`~kolossos.auto_parallel.autoparallelize` runs on.

``device_mesh`` may be ``None`` (every rank of the default group, 1-d), a torch ``DeviceMesh``
or a kolossos :class:`~kolossos.device.device_mesh.DeviceMesh`, of 1 or 2 dimensions, holding
every rank of the job.

* **1-d** (or ``None``): every plan family runs over its ranks, and each ``D × T`` layout of
  them (``D, T ≥ 2``, ``D`` dividing the batch) is considered for ``dp{D}xtp{T}``; the executor
  lays those ranks out itself.
* **2-d**, shape ``(D, T)``: read as data parallel × tensor parallel — dim 0 data parallel,
  dim 1 tensor parallel, or by ``mesh_dim_names`` ``("dp", "tp")`` in either order. The families
  on it are ``dp``, ``megatron`` and ``replicated`` over all its ranks (the flattened mesh) and
  ``dp{D}xtp{T}`` on the mesh's own two axes; no other layout of the ranks is tried. An axis of
  size 1 adds no ``dp × tp`` family (``dp`` or ``megatron`` over all ranks is that plan).

:func:`check_mesh` and :func:`check_transformer_sizes` validate without any collective;
:func:`resolve_mesh` then builds the torch meshes (a collective).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh

__all__ = [
    "DIM_NAMES",
    "AutoMesh",
    "check_mesh",
    "check_transformer_sizes",
    "hybrid_sizes",
    "resolve_mesh",
]

DIM_NAMES = ("dp", "tp")
"""The names of a 2-d mesh's data-parallel and tensor-parallel axes."""


@dataclass(frozen=True)
class AutoMesh:
    """The meshes the plan families run on."""

    flat: TorchDeviceMesh
    """1-d over every rank (``dp``, ``megatron``, ``replicated``): the user's 1-d mesh, or the
    user's 2-d mesh flattened in its row-major order."""
    grid: TorchDeviceMesh | None = None
    """The user's 2-d mesh with axes named ``("dp", "tp")`` (``dp{D}xtp{T}``); ``None`` on a
    1-d mesh, where the executor lays out ``D × T`` itself."""


def _shape(device_mesh: Any, world_size: int) -> tuple[int, ...]:
    if device_mesh is None:
        return (world_size,)
    if isinstance(device_mesh, TorchDeviceMesh):
        return tuple(device_mesh.shape)
    shape = getattr(device_mesh, "shape", None)
    if shape is None or not hasattr(device_mesh, "get_torch_mesh"):
        raise TypeError(
            f"device_mesh={device_mesh!r} must be a torch DeviceMesh, a kolossos DeviceMesh or "
            "None (all ranks); build one with torch.distributed.device_mesh.init_device_mesh."
        )
    return tuple(int(n) for n in shape)


def _names(device_mesh: Any) -> tuple[str, ...] | None:
    if isinstance(device_mesh, TorchDeviceMesh):
        return device_mesh.mesh_dim_names
    return None


def _axes(names: Sequence[str] | None) -> tuple[int, int]:
    """(data-parallel dim, tensor-parallel dim) of a 2-d mesh with these dim names."""
    if names is None:
        return 0, 1
    if sorted(names) != sorted(DIM_NAMES):
        raise ValueError(
            f"device_mesh has mesh_dim_names={tuple(names)}; autoparallelize reads a 2-d mesh "
            f"as data parallel x tensor parallel, so name its dims {DIM_NAMES} (either order) "
            "or leave them unnamed (dim 0 data parallel, dim 1 tensor parallel)."
        )
    return list(names).index("dp"), list(names).index("tp")


def check_mesh(device_mesh: Any, world_size: int) -> tuple[int, int] | None:
    """Validate ``device_mesh`` (no collective) and return ``(D, T)`` for a 2-d mesh, ``None``
    for a 1-d one.

    Raises:
        TypeError: not a mesh.
        NotImplementedError: more than 2 dimensions.
        ValueError: the mesh does not hold ``world_size`` ranks, or 2-d dim names other than
            ``("dp", "tp")``.
    """
    shape = _shape(device_mesh, world_size)
    if len(shape) not in (1, 2):
        raise NotImplementedError(
            f"autoparallelize supports 1-d and 2-d (data parallel x tensor parallel) meshes; "
            f"got shape {shape}. Pass a mesh of shape (world_size,) or (D, T)."
        )
    if math.prod(shape) != world_size:
        raise ValueError(
            f"device_mesh of shape {shape} holds {math.prod(shape)} ranks but the job has "
            f"{world_size}; autoparallelize needs a mesh of every rank (product of the shape "
            f"== world size). Pass a mesh of {world_size} ranks or None."
        )
    if len(shape) == 1:
        return None
    data, tensor = _axes(_names(device_mesh))
    return shape[data], shape[tensor]


def check_transformer_sizes(model: Any, dp_tp: tuple[int, int], batch: int) -> None:
    """On a ``(D, T)`` mesh: the batch splits over ``D`` and the attention heads over ``T``.

    Raises:
        ValueError: naming the value, the rule and the fix.
    """
    dp, tp = dp_tp
    if batch % dp:
        raise ValueError(
            f"the batch of {batch} (dimension 0 of meta_input_samples) does not split over the "
            f"mesh's {dp} data-parallel ranks (dim 0 / 'dp'): it must be a multiple of {dp}. "
            "Change the batch size or the mesh shape."
        )
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"the model's {field}={heads} does not split over the mesh's {tp} "
                f"tensor-parallel ranks (dim 1 / 'tp'): it must be a multiple of {tp}. "
                "Use a mesh whose tensor-parallel size divides the heads."
            )


def resolve_mesh(device_mesh: Any) -> AutoMesh:
    """The torch meshes of a mesh :func:`check_mesh` accepted (COLLECTIVE: creates groups)."""
    if device_mesh is None:
        return AutoMesh(flat=init_device_mesh("cpu", (dist.get_world_size(),)))
    if isinstance(device_mesh, TorchDeviceMesh):
        mesh, names = device_mesh, device_mesh.mesh_dim_names
    else:  # a kolossos DeviceMesh: its global layout when it has one
        logical = device_mesh.logical_mesh_id
        if logical is None or logical.dim() == 1:
            mesh, names = device_mesh.get_torch_mesh(), None
        else:
            mesh = TorchDeviceMesh(device_mesh.device_type, logical, mesh_dim_names=DIM_NAMES)
            names = DIM_NAMES
    if mesh.ndim == 1:
        return AutoMesh(flat=mesh)
    data, tensor = _axes(names)
    ranks = mesh.mesh.permute(data, tensor)
    if names is None or tuple(names) != DIM_NAMES:
        mesh = TorchDeviceMesh(mesh.device_type, ranks, mesh_dim_names=DIM_NAMES)
    flat = TorchDeviceMesh(mesh.device_type, ranks.reshape(-1))
    return AutoMesh(flat=flat, grid=mesh)


def hybrid_sizes(dp_tp: tuple[int, int] | None, world_size: int, batch: int) -> list[int]:
    """The data-parallel sizes ``D`` of the ``dp{D}xtp{T}`` families to consider: on a
    ``(D, T)`` mesh ``[D]`` when both are at least 2; on a 1-d mesh every ``D ≥ 2`` dividing
    the world and the batch with ``T = world / D ≥ 2``."""
    if dp_tp is not None:
        return [dp_tp[0]] if min(dp_tp) >= 2 else []
    return [dp for dp in range(2, world_size // 2 + 1) if world_size % dp == 0 and batch % dp == 0]
