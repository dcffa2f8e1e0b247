"""The ``q x q`` process grid of 2D (SUMMA) tensor parallelism: :class:`Groups2D`.

Rank ``(i, j)`` of the grid sits in row ``i`` and column ``j``. Its *row group* holds the ``q``
ranks of row ``i`` (ordered by column, so its rank there is ``j``); its *column group* holds the
``q`` ranks of column ``j`` (ordered by row, so its rank there is ``i``). Colossal-AI calls these
``PARALLEL_2D_ROW`` and ``PARALLEL_2D_COL``.

A tensor ``X`` of shape ``[B, ..., H]`` is laid out over the grid as the docs do: rank ``(i, j)``
holds ``chunk(chunk(X, q, 0)[i], q, -1)[j]`` (batch block ``i``, feature block ``j``).

Example:
    >>> groups = Groups2D(row=row_group, col=col_group)  # doctest: +SKIP
    >>> groups.q, groups.row_index, groups.col_index  # doctest: +SKIP
    (2, 1, 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Groups2D", "check_divisible", "summa_dim"]


def summa_dim(tensor_parallel_size: int) -> int:
    """``q`` such that ``q * q == tensor_parallel_size``.

    Raises:
        ValueError: the size is not a positive perfect square.

    Example:
        >>> summa_dim(4)
        2
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
        raise TypeError(f"tensor parallel size {tensor_parallel_size!r} must be an int.")
    q = math.isqrt(max(tensor_parallel_size, 0))
    if tensor_parallel_size < 1 or q * q != tensor_parallel_size:
        raise ValueError(
            f"2D tensor parallelism needs a square number of ranks (q x q), got "
            f"{tensor_parallel_size}; use a size such as 4, 9 or 16."
        )
    return q


def check_divisible(owner: str, what: str, value: int, divisor: int) -> int:
    """``value // divisor``, or a ``ValueError`` naming ``what`` when it does not divide.

    Example:
        >>> check_divisible("Linear2D", "out_features", 1024, 2)
        512
    """
    if value % divisor:
        raise ValueError(
            f"{owner}: {what}={value} is not divisible by {divisor} (2D tensor parallelism splits "
            f"it into {divisor} equal parts); choose {what} as a multiple of {divisor}."
        )
    return value // divisor


@dataclass(frozen=True, eq=False)
class Groups2D:
    """The row and column process groups of this rank in a ``q x q`` SUMMA grid.

    Equality is identity (process groups have no value equality); ``copy.deepcopy`` returns the
    same object (a communicator cannot be copied).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: the two groups differ in size, or this rank is not in both.
    """

    row: ProcessGroup
    """The ranks of this rank's grid row (same row index ``i``), ordered by column ``j``."""
    col: ProcessGroup
    """The ranks of this rank's grid column (same column index ``j``), ordered by row ``i``."""
    q: int = field(init=False)
    """Side of the grid (``P = q * q`` ranks)."""
    row_index: int = field(init=False)
    """``i``: this rank's row, i.e. its rank in :attr:`col`."""
    col_index: int = field(init=False)
    """``j``: this rank's column, i.e. its rank in :attr:`row`."""
    row_ranks: tuple[int, ...] = field(init=False)
    """Global ranks of :attr:`row`, by column."""
    col_ranks: tuple[int, ...] = field(init=False)
    """Global ranks of :attr:`col`, by row."""

    def __post_init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "Groups2D needs torch.distributed; call kolossos.launch(...) (or "
                "torch.distributed.init_process_group) first."
            )
        q_row, q_col = dist.get_world_size(self.row), dist.get_world_size(self.col)
        if q_row != q_col:
            raise ValueError(
                f"Groups2D: the row group has {q_row} ranks and the column group {q_col}; a SUMMA "
                "grid is square, pass the row and column groups of one q x q grid."
            )
        i, j = dist.get_rank(self.col), dist.get_rank(self.row)
        if i < 0 or j < 0:
            raise ValueError(
                f"Groups2D: rank {dist.get_rank()} is not a member of both groups; pass this "
                "rank's own row and column groups."
            )
        set_ = object.__setattr__
        set_(self, "q", q_row)
        set_(self, "row_index", i)
        set_(self, "col_index", j)
        set_(self, "row_ranks", tuple(dist.get_process_group_ranks(self.row)))
        set_(self, "col_ranks", tuple(dist.get_process_group_ranks(self.col)))

    def __deepcopy__(self, memo: dict[int, object]) -> Groups2D:
        return self

    def group(self, axis: str) -> ProcessGroup:
        """:attr:`row` for ``"row"``, :attr:`col` for ``"col"``."""
        if axis == "row":
            return self.row
        if axis == "col":
            return self.col
        raise ValueError(f"axis={axis!r} must be 'row' or 'col'.")

    def index(self, axis: str) -> int:
        """This rank's rank in :meth:`group` of ``axis`` (``col_index`` for ``"row"``)."""
        return self.col_index if axis == "row" else self.row_index

    def __repr__(self) -> str:
        return f"Groups2D(q={self.q}, row_index={self.row_index}, col_index={self.col_index})"
