"""How a 3D tensor-parallel parameter is cut: :class:`Shard3DSpec`, attached to the parameter.

A 1D shard is one even split over one group
(:class:`~kolossos.nn.layer.parallel_1d.sharding.TPShardSpec`). A 3D shard is split over up to
three groups, possibly two of them along the same dimension, and is often *replicated* over the
others: a linear bias is split over the input group and repeated on the ``q**2`` ranks of the
output x weight plane. The spec records the splits (outermost first) and the number of ranks of
the cube holding the same values, so

* :func:`gather_3d_full` / :func:`slice_3d_shard` rebuild the full tensor or cut a shard of it
  in the layout the layer stores (``Linear3D`` keeps Colossal-AI's ``(in, out)`` weight);
  :meth:`Shard3DSpec.gather` / :meth:`Shard3DSpec.shard` do the same in the dense layer's layout
  (``nn.Linear``'s ``(out, in)``), as the mode-independent
  :class:`~kolossos.nn.layer.shard_layout.ShardLayout` promises;
* a global gradient norm counts each element once: the sum of ``|g|^p`` over all ``q**3`` ranks
  of the cube, each rank's share divided by :attr:`Shard3DSpec.replicas`
  (:func:`~kolossos.nn.layer.shard_layout.get_shard_layout`).

Example:
    >>> spec = get_3d_spec(layer.weight)  # doctest: +SKIP
    >>> full = gather_3d_full(layer.weight.detach(), spec)  # COLLECTIVE  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import all_gather_along

__all__ = [
    "MARK_ATTR_3D",
    "Shard3DSpec",
    "gather_3d_full",
    "get_3d_spec",
    "set_3d_spec",
    "slice_3d_shard",
]

MARK_ATTR_3D = "_kolossos_tp3d_spec"
"""The tensor attribute holding a parameter's :class:`Shard3DSpec`."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Shard3DSpec:
    """The layout of one 3D tensor-parallel shard (equality is identity)."""

    full_shape: tuple[int, ...]
    """Shape of the full tensor in the dense layer's layout (``nn.Linear``'s ``(out, in)``)."""
    splits: tuple[tuple[int, ProcessGroup], ...]
    """``(dim, group)`` pairs, outermost first: the full tensor as the layer stores it
    (:attr:`stored_shape`) is chunked along ``dim`` over ``group`` (this rank keeps its rank's
    chunk), then the chunk by the next pair."""
    replicas: int
    """Ranks of the cube holding this same shard (1: fully sharded; ``q**3``: replicated)."""
    transposed: bool = False
    """The layer stores the transpose of the dense tensor (2-D only; ``Linear3D``'s ``(in, out)``
    weight): :attr:`splits`, :func:`gather_3d_full` and :func:`slice_3d_shard` work on the
    transpose."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"Shard3DSpec replicas={self.replicas} must be >= 1.")
        if self.transposed and len(self.full_shape) != 2:
            raise ValueError(
                f"Shard3DSpec: transposed=True needs a 2-D tensor, got full_shape "
                f"{self.full_shape}."
            )
        shape = list(self.stored_shape)
        for dim, group in self.splits:
            world = dist.get_world_size(group)
            if not 0 <= dim < len(shape) or shape[dim] % world:
                raise ValueError(
                    f"Shard3DSpec: cannot split dim {dim} of {tuple(shape)} over {world} ranks "
                    f"(stored full shape {self.stored_shape})."
                )
            shape[dim] //= world

    def __deepcopy__(self, memo: dict[int, object]) -> Shard3DSpec:
        return self  # immutable, and its process groups cannot be copied

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the full tensor in the layout the layer stores (:attr:`full_shape`,
        reversed when :attr:`transposed`)."""
        return tuple(reversed(self.full_shape)) if self.transposed else self.full_shape

    def shard_shape(self) -> tuple[int, ...]:
        """The shape of each rank's shard."""
        shape = list(self.stored_shape)
        for dim, group in self.splits:
            shape[dim] //= dist.get_world_size(group)
        return tuple(shape)

    # -- the ShardLayout contract (kolossos.nn.layer.shard_layout) --------------------------
    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor in the dense layout (:attr:`full_shape`). COLLECTIVE over each group
        of :attr:`splits`."""
        full = gather_3d_full(local, self)
        return full.t().contiguous() if self.transposed else full

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the dense ``full`` (no communication).

        Raises:
            ValueError: ``full`` does not have :attr:`full_shape`.
        """
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"Shard3DSpec.shard: tensor of shape {tuple(full.shape)} is not the full shape "
                f"{self.full_shape}."
            )
        return slice_3d_shard(full.t() if self.transposed else full, self)


def set_3d_spec(param: torch.Tensor, spec: Shard3DSpec) -> None:
    """Attach ``spec`` to ``param``.

    Raises:
        ValueError: ``param``'s shape is not the shard shape of ``spec``.
    """
    if tuple(param.shape) != spec.shard_shape():
        raise ValueError(
            f"set_3d_spec: parameter of shape {tuple(param.shape)} is not a shard "
            f"{spec.shard_shape()} of {spec.full_shape}."
        )
    setattr(param, MARK_ATTR_3D, spec)


def get_3d_spec(tensor: torch.Tensor) -> Shard3DSpec | None:
    """The :class:`Shard3DSpec` attached to ``tensor``, or ``None``."""
    spec = getattr(tensor, MARK_ATTR_3D, None)
    return spec if isinstance(spec, Shard3DSpec) else None


def gather_3d_full(tensor: torch.Tensor, spec: Shard3DSpec) -> torch.Tensor:
    """The full tensor from every rank's shard, in the layout the layer stores
    (``spec.stored_shape``; :meth:`Shard3DSpec.gather` for the dense layout).

    COLLECTIVE over each group of ``spec.splits`` (all ranks of the cube call it together).
    """
    if tuple(tensor.shape) != spec.shard_shape():
        raise ValueError(
            f"gather_3d_full: tensor of shape {tuple(tensor.shape)} is not a shard of "
            f"{spec.full_shape} (expected {spec.shard_shape()})."
        )
    full = tensor.detach()
    for dim, group in reversed(spec.splits):  # innermost split first
        full = all_gather_along(full, dim, group)
    return full.contiguous()


def slice_3d_shard(full: torch.Tensor, spec: Shard3DSpec) -> torch.Tensor:
    """This rank's shard of ``full``, given in the layout the layer stores
    (``spec.stored_shape``; :meth:`Shard3DSpec.shard` takes the dense layout). No communication.

    Raises:
        ValueError: ``full`` does not have ``spec.stored_shape``.
    """
    if tuple(full.shape) != spec.stored_shape:
        raise ValueError(
            f"slice_3d_shard: tensor of shape {tuple(full.shape)} is not the stored full shape "
            f"{spec.stored_shape}."
        )
    part = full
    for dim, group in spec.splits:
        part = part.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]
    return part.contiguous()
