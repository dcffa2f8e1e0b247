"""How a 2D tensor-parallel parameter is cut: :class:`Shard2DSpec`, attached to the parameter.

A 2D layer keeps one block of each sharded tensor on every rank of the ``q x q`` grid, and every
element of the full tensor lives on exactly one rank. The spec says how: starting from the full
(dense) tensor — transposed first when :attr:`Shard2DSpec.transposed` — each entry
``(dim, axis)`` of :attr:`Shard2DSpec.splits` cuts ``dim`` into ``q`` equal pieces and keeps the
piece of this rank's index along ``axis`` (``"row"``: the pieces lie on the ranks of the row
group, so the piece index is the column ``j``; ``"col"``: on the column group, index ``i``).

Examples (``nn.Linear`` names and layouts):

=======================  ==========================  ============================  ===============
parameter                full tensor                 splits                        block
=======================  ==========================  ============================  ===============
``Linear2D.weight``      ``[out, in]`` (transposed)  ``((0, "col"), (1, "row"))``  ``[in/q, out/q]``
``Linear2D.bias``        ``[out]``                   ``((0, "row"), (0, "col"))``  ``[out/q²]``
``Classifier2D.weight``  ``[N, in]``                 ``((1, "row"), (1, "col"))``  ``[N, in/q²]``
=======================  ==========================  ============================  ===============

:func:`gather_2d_full` rebuilds the full tensor (COLLECTIVE over both groups) and
:func:`slice_2d_shard` cuts this rank's block from it (no communication).

Gradient norms: a parameter with a spec is partitioned over the whole grid (count its squares
once per rank and sum over the ``q x q`` ranks); a parameter without one is replicated on every
rank of the grid (count it once).

The spec satisfies the mode-independent :class:`~kolossos.nn.layer.shard_layout.ShardLayout`
(``gather`` / ``shard`` / ``replicas``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kolossos.nn.layer.parallel_1d._comm import all_gather_along
from kolossos.nn.layer.parallel_2d.grid import Groups2D

__all__ = [
    "MARK_2D_ATTRS",
    "Shard2DSpec",
    "gather_2d_full",
    "get_2d_spec",
    "is_2d_sharded",
    "set_2d_spec",
    "slice_2d_shard",
]

_SPEC_ATTR = "_kolossos_2d_spec"
MARK_2D_ATTRS = (_SPEC_ATTR,)
"""Tensor attributes this module sets (torch's ``Parameter.__deepcopy__`` and
``load_state_dict(assign=True)`` drop them; the 2D layers put them back)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Shard2DSpec:
    """The layout of one 2D tensor-parallel block (see the module docstring).

    Raises:
        ValueError: a split dimension out of range or not divisible by ``q``, a transposed
            tensor that is not 2-D, or an unknown axis.
    """

    full_shape: tuple[int, ...]
    """Shape of the full tensor, as the dense module stores it."""
    splits: tuple[tuple[int, str], ...]
    """``(dim, axis)`` cuts applied in order (``dim`` of the possibly transposed tensor)."""
    transposed: bool = False
    """The block is cut from the full tensor's transpose (``Linear2D`` keeps ``[in, out]``)."""
    groups: Groups2D
    """The grid the tensor is spread over."""

    def __post_init__(self) -> None:
        if self.transposed and len(self.full_shape) != 2:
            raise ValueError(
                "Shard2DSpec: transposed=True needs a 2-D tensor, got full_shape "
                f"{self.full_shape}."
            )
        shape = list(self._oriented_shape())
        for dim, axis in self.splits:
            if axis not in ("row", "col"):
                raise ValueError(f"Shard2DSpec: axis {axis!r} must be 'row' or 'col'.")
            if not 0 <= dim < len(shape):
                raise ValueError(
                    f"Shard2DSpec: split dim {dim} must lie in [0, {len(shape)}) for full_shape "
                    f"{self.full_shape}."
                )
            if shape[dim] % self.groups.q:
                raise ValueError(
                    f"Shard2DSpec: dimension {dim} of size {shape[dim]} (full_shape "
                    f"{self.full_shape}) cannot be split into q={self.groups.q} equal parts."
                )
            shape[dim] //= self.groups.q

    def __deepcopy__(self, memo: dict[int, object]) -> Shard2DSpec:
        return self  # immutable; its process groups cannot be copied

    def _oriented_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.full_shape)) if self.transposed else self.full_shape

    def shard_shape(self) -> tuple[int, ...]:
        """The shape of every rank's block."""
        shape = list(self._oriented_shape())
        for dim, _ in self.splits:
            shape[dim] //= self.groups.q
        return tuple(shape)

    # -- the ShardLayout contract (kolossos.nn.layer.shard_layout) --------------------------
    @property
    def replicas(self) -> int:
        """Ranks of the grid holding each element: 1 when the splits use both the row and the
        column axis (every 2D layer's parameters), ``q`` for a tensor split along one axis."""
        return self.groups.q ** (2 - len({axis for _, axis in self.splits}))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """:func:`gather_2d_full` of ``local`` (the dense layout). COLLECTIVE over the grid."""
        return gather_2d_full(local, self)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of the dense ``full`` (:func:`slice_2d_shard`); no communication."""
        return slice_2d_shard(full, self)


def set_2d_spec(param: torch.Tensor, spec: Shard2DSpec) -> None:
    """Attach ``spec`` to ``param`` (a parameter holding this rank's block).

    Raises:
        ValueError: ``param``'s shape is not the block shape of the spec.
    """
    if tuple(param.shape) != spec.shard_shape():
        raise ValueError(
            f"set_2d_spec: parameter of shape {tuple(param.shape)} is not a block "
            f"{spec.shard_shape()} of full_shape {spec.full_shape}."
        )
    setattr(param, _SPEC_ATTR, spec)


def get_2d_spec(tensor: torch.Tensor) -> Shard2DSpec | None:
    """The :class:`Shard2DSpec` attached to ``tensor``, or ``None`` (replicated on the grid)."""
    spec = getattr(tensor, _SPEC_ATTR, None)
    return spec if isinstance(spec, Shard2DSpec) else None


def is_2d_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a block of a 2D-sharded tensor (partitioned over the whole grid:
    the gradient-norm code sums its ``|g|^p`` over all ``q x q`` ranks)."""
    return get_2d_spec(tensor) is not None


def gather_2d_full(tensor: torch.Tensor, spec: Shard2DSpec) -> torch.Tensor:
    """Rebuild the full tensor from every rank's block.

    COLLECTIVE over the row and column groups of ``spec.groups``: every rank of the grid must
    call it, in the same order.

    Args:
        tensor: this rank's block (a parameter, its gradient or an optimizer state).
        spec: the parameter's :class:`Shard2DSpec`.

    Returns:
        A new tensor of shape ``spec.full_shape``.
    """
    if tuple(tensor.shape) != spec.shard_shape():
        raise ValueError(
            f"gather_2d_full: tensor of shape {tuple(tensor.shape)} is not a block of "
            f"{spec.full_shape} (expected {spec.shard_shape()})."
        )
    full = tensor.detach()
    for dim, axis in reversed(spec.splits):  # undo the cuts, last first
        full = all_gather_along(full, dim, spec.groups.group(axis))  # SYNC POINT
    if spec.transposed:
        full = full.t()
    return full.contiguous()


def slice_2d_shard(full: torch.Tensor, spec: Shard2DSpec) -> torch.Tensor:
    """Cut this rank's block out of ``full`` (no communication).

    Raises:
        ValueError: ``full`` does not have ``spec.full_shape``.
    """
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(
            f"slice_2d_shard: tensor of shape {tuple(full.shape)} is not the full shape "
            f"{spec.full_shape} the spec describes."
        )
    block = full.t() if spec.transposed else full
    for dim, axis in spec.splits:
        block = block.chunk(spec.groups.q, dim=dim)[spec.groups.index(axis)]
    return block.contiguous()
