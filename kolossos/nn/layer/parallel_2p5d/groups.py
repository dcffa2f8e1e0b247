"""The process groups of 2.5D (Tesseract) tensor parallelism and this rank's place in them.

``P = q * q * d`` ranks form ``d`` depth layers of a ``q x q`` grid. A rank has a *row index*
``i``, a *column index* ``j`` (both in ``[0, q)``) and a *depth index* ``k`` (in ``[0, d)``).

* ``row``: the ``q`` ranks of this rank's grid row (same ``i`` and ``k``, ``j`` varies) —
  Colossal-AI's ``ParallelMode.PARALLEL_2P5D_ROW``; this rank's rank in it is ``j``.
* ``col``: the ``q`` ranks of this rank's grid column (same ``j`` and ``k``, ``i`` varies) —
  ``PARALLEL_2P5D_COL``; this rank's rank in it is ``i``.
* ``dep``: the ``d`` ranks holding the same weight block (same ``i`` and ``j``) —
  ``PARALLEL_2P5D_DEP``; rank ``k``.
* ``xz``: the ``d * q`` ranks of one column across all layers (same ``j``) —
  ``PARALLEL_2P5D_XZ``; rank ``k * q + i``, the index of the batch block this rank holds.
* ``tensor``: all ``q * q * d`` ranks.

Activations are split into ``d * q`` row (batch) blocks — block ``k * q + i`` on rank
``(i, j, k)`` — and ``q`` column (feature) blocks — block ``j``. Weights are split into ``q x q``
blocks, block ``(i, j)`` on rank ``(i, j, k)`` for every ``k`` (replicated over depth).

Example:
    >>> groups = new_groups_2p5d(depth=2)  # 8 ranks: q = 2, d = 2  # doctest: +SKIP
    >>> groups.tesseract_dim, groups.tesseract_dep  # doctest: +SKIP
    (2, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Groups2p5D", "divide", "new_groups_2p5d", "tesseract_dim"]


def tesseract_dim(size: int, depth: int) -> int:
    """The grid side ``q`` of a tesseract of ``size = q * q * depth`` ranks.

    Raises:
        ValueError: ``depth`` is not a positive int dividing ``size``, or ``size / depth`` is not
            a perfect square.

    Example:
        >>> tesseract_dim(8, 2)
        2
    """
    for name, value in (("size", size), ("depth", depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"2.5D tensor parallelism: {name}={value!r} must be a positive int.")
    if size % depth:
        raise ValueError(
            f"2.5D tensor parallelism needs size = q*q*depth; depth={depth} does not divide "
            f"size={size}. Pick a depth that divides the tensor-parallel size (e.g. size=8, "
            "depth=2)."
        )
    q = math.isqrt(size // depth)
    if q * q * depth != size:
        raise ValueError(
            f"2.5D tensor parallelism needs size = q*q*depth; size={size} / depth={depth} = "
            f"{size // depth} is not a perfect square. Use e.g. size=8 with depth=2, or size=4 "
            "with depth=1."
        )
    return q


def divide(value: int, parts: int, what: str, owner: str) -> int:
    """``value // parts``, refusing a remainder.

    Raises:
        ValueError: ``value`` is not a positive multiple of ``parts``.

    Example:
        >>> divide(256, 2, "in_features", "Linear2p5D")
        128
    """
    if value < 1 or value % parts:
        raise ValueError(
            f"{owner}: {what}={value} must be a positive multiple of {parts} (the 2.5D grid "
            f"splits it into {parts} parts); pad it or pick another tensor-parallel size."
        )
    return value // parts


@dataclass(frozen=True, kw_only=True, eq=False)
class Groups2p5D:
    """The process groups of one tesseract and this rank's indices in it (see the module
    docstring). Build it with :func:`new_groups_2p5d` or :meth:`from_groups`; the constructor
    only checks the integers (no communication), so the layers validate their sizes before
    touching a group.

    Equality is identity (``eq=False``): process groups have no value equality.
    """

    row: ProcessGroup
    """Same row and depth, the column index varies (``PARALLEL_2P5D_ROW``)."""
    col: ProcessGroup
    """Same column and depth, the row index varies (``PARALLEL_2P5D_COL``)."""
    dep: ProcessGroup
    """Same row and column, the depth index varies (``PARALLEL_2P5D_DEP``)."""
    xz: ProcessGroup
    """Same column, depth and row vary; rank ``depth_index * q + row_index``
    (``PARALLEL_2P5D_XZ``)."""
    tensor: ProcessGroup
    """All ``q * q * d`` ranks of the tesseract."""
    tesseract_dim: int
    """``q``, the side of each depth layer's grid."""
    tesseract_dep: int
    """``d``, the number of depth layers."""
    row_index: int
    """``i``: this rank's grid row (its rank in :attr:`col`)."""
    col_index: int
    """``j``: this rank's grid column (its rank in :attr:`row`)."""
    depth_index: int
    """``k``: this rank's depth layer (its rank in :attr:`dep`)."""

    def __post_init__(self) -> None:
        tesseract_dim(self.tesseract_dim**2 * self.tesseract_dep, self.tesseract_dep)
        q, d = self.tesseract_dim, self.tesseract_dep
        for name, value, bound in (
            ("row_index", self.row_index, q),
            ("col_index", self.col_index, q),
            ("depth_index", self.depth_index, d),
        ):
            if not 0 <= value < bound:
                raise ValueError(f"Groups2p5D: {name}={value} must lie in [0, {bound}).")

    def __deepcopy__(self, memo: dict[int, object]) -> Groups2p5D:
        return self  # immutable, and process groups cannot be copied

    @property
    def batch_parts(self) -> int:
        """``d * q``: the number of row (batch) blocks activations are split into."""
        return self.tesseract_dep * self.tesseract_dim

    @property
    def batch_index(self) -> int:
        """``k * q + i``: the row (batch) block this rank holds (its rank in :attr:`xz`)."""
        return self.depth_index * self.tesseract_dim + self.row_index

    @classmethod
    def from_groups(
        cls,
        *,
        row: ProcessGroup,
        col: ProcessGroup,
        dep: ProcessGroup,
        xz: ProcessGroup,
        tensor: ProcessGroup,
    ) -> Groups2p5D:
        """Read this rank's indices from existing groups (no communication).

        Raises:
            ValueError: the group sizes do not form a tesseract, or the ``xz`` group is not
                ordered depth-major (rank ``k * q + i``).
        """
        q, d = dist.get_world_size(row), dist.get_world_size(dep)
        sizes = {
            "col": dist.get_world_size(col),
            "xz": dist.get_world_size(xz),
            "tensor": dist.get_world_size(tensor),
        }
        if sizes != {"col": q, "xz": d * q, "tensor": q * q * d}:
            raise ValueError(
                f"Groups2p5D: group sizes row={q}, dep={d}, {sizes} do not form a q x q x d "
                f"tesseract (expected col={q}, xz={d * q}, tensor={q * q * d})."
            )
        i, j, k = dist.get_rank(col), dist.get_rank(row), dist.get_rank(dep)
        if dist.get_rank(xz) != k * q + i:
            raise ValueError(
                f"Groups2p5D: this rank is {dist.get_rank(xz)} in the xz group, expected "
                f"depth_index * q + row_index = {k * q + i}; order the xz ranks depth-major."
            )
        return cls(
            row=row,
            col=col,
            dep=dep,
            xz=xz,
            tensor=tensor,
            tesseract_dim=q,
            tesseract_dep=d,
            row_index=i,
            col_index=j,
            depth_index=k,
        )


def new_groups_2p5d(depth: int, tensor_size: int | None = None) -> Groups2p5D:
    """Create the tesseract groups over the world, in blocks of ``tensor_size`` consecutive
    ranks (Colossal-AI's layout: inside a block, rank ``j + q * i + q * q * k``).

    COLLECTIVE over the world: every rank must call it with the same arguments (each group is
    created by every rank, in the same order).

    Args:
        depth: ``d``, the number of depth layers.
        tensor_size: ranks per tesseract (default: the world size).

    Raises:
        ValueError: the sizes do not form a tesseract or do not divide the world.
    """
    world = dist.get_world_size()
    size = world if tensor_size is None else tensor_size
    q = tesseract_dim(size, depth)
    if world % size:
        raise ValueError(
            f"new_groups_2p5d: tensor_size={size} does not divide the world size {world}."
        )
    me = dist.get_rank()
    r = range(q)
    found: dict[str, ProcessGroup] = {}
    for base in range(0, world, size):

        def at(i: int, j: int, k: int, base: int = base) -> int:
            return base + j + q * i + q * q * k

        layouts = {
            "row": [[at(i, j, k) for j in r] for i in r for k in range(depth)],
            "col": [[at(i, j, k) for i in r] for j in r for k in range(depth)],
            "dep": [[at(i, j, k) for k in range(depth)] for i in r for j in r],
            "xz": [[at(i, j, k) for k in range(depth) for i in r] for j in r],
            "tensor": [list(range(base, base + size))],
        }
        for name, rank_lists in layouts.items():
            for ranks in rank_lists:
                group = dist.new_group(ranks)
                if me in ranks:
                    found[name] = group
    return Groups2p5D.from_groups(**found)
