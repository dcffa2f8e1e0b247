"""The process groups of 3D tensor parallelism: a cube of ``P = q x q x q`` ranks.

A rank of the cube has three coordinates. Colossal-AI names the three lines through it after
the role they play in ``Y = X A`` (F0:6726-6782):

* the **input** group: the ranks that all-gather the input ``X`` (and reduce-scatter ``dX``);
* the **weight** group: the ranks that all-gather the weight ``A`` (and reduce-scatter ``dA``);
* the **output** group: the ranks that reduce-scatter the output ``Y`` (and all-gather ``dY``);

and two planes: **input x weight** (input and weight lines together) and **output x weight**,
over which replicated parameters sum their gradients.

Inside a block of ``q**3`` consecutive ranks the layout is the legacy initializer's: the rank at
``(w, i, o)`` is ``base + w + q * (i + q * o)`` (the weight coordinate innermost), so the groups
built here and the ``ParallelMode.PARALLEL_3D_*`` groups of the legacy context are the same.

A linear layer leaves its output laid out with the input and output roles exchanged, so the next
layer uses :meth:`Groups3D.swapped` (Colossal-AI swaps its global environment instead).

Example:
    >>> groups = build_groups_3d()  # COLLECTIVE: every rank of the world  # doctest: +SKIP
    >>> fc1 = Linear3D(256, 1024, groups=groups)  # doctest: +SKIP
    >>> fc2 = Linear3D(1024, 256, groups=fc1.output_groups)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "Groups3D",
    "build_groups_3d",
    "check_cube",
    "cube_rank_lists",
    "divide_3d",
]


def check_cube(size: int) -> int:
    """The edge ``q`` of a cube of ``size`` ranks.

    Raises:
        ValueError: ``size`` is not a positive perfect cube.

    Example:
        >>> check_cube(8)
        2
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"3D tensor parallelism: size={size!r} must be a positive int.")
    q = round(size ** (1 / 3))
    for edge in (q - 1, q, q + 1):
        if edge > 0 and edge**3 == size:
            return edge
    raise ValueError(
        f"3D tensor parallelism needs a cube number of ranks (1, 8, 27, 64, ...), got {size}; "
        "change parallel.tensor.size or the number of processes."
    )


def divide_3d(value: int, by: int, what: str) -> int:
    """``value // by``, checked.

    Raises:
        ValueError: ``value`` is not a positive multiple of ``by``.

    Example:
        >>> divide_3d(1024, 4, "out_features")
        256
    """
    if value <= 0 or value % by:
        raise ValueError(
            f"3D tensor parallelism: {what}={value} must be a positive multiple of {by} (the "
            "cube edge q or q**2 for this dimension); pad it or pick another tensor size."
        )
    return value // by


def cube_rank_lists(world_size: int, tensor_size: int) -> dict[str, list[list[int]]]:
    """Every 3D group of a world cut into blocks of ``tensor_size`` consecutive ranks, by role
    (``input``, ``weight``, ``output``, ``input_x_weight``, ``output_x_weight``, ``tensor``), in
    the order every rank must create them.

    Raises:
        ValueError: ``tensor_size`` is not a cube or does not divide ``world_size``.

    Example:
        >>> cube_rank_lists(8, 8)["input"][:2]
        [[0, 2], [4, 6]]
    """
    q = check_cube(tensor_size)
    if world_size % tensor_size:
        raise ValueError(
            f"3D tensor parallelism: world size {world_size} is not a multiple of the tensor "
            f"size {tensor_size}."
        )
    r = range(q)
    lists: dict[str, list[list[int]]] = {k: [] for k in (*_ROLES, "tensor")}
    for base in range(0, world_size, tensor_size):

        def at(w: int, i: int, o: int, base: int = base) -> int:
            return base + w + q * (i + q * o)

        lists["input"] += [[at(w, i, o) for i in r] for w in r for o in r]
        lists["weight"] += [[at(w, i, o) for w in r] for o in r for i in r]
        lists["output"] += [[at(w, i, o) for o in r] for w in r for i in r]
        lists["input_x_weight"] += [[at(w, i, o) for i in r for w in r] for o in r]
        lists["output_x_weight"] += [[at(w, i, o) for o in r for w in r] for i in r]
        lists["tensor"].append(list(range(base, base + tensor_size)))
    return lists


_ROLES = ("input", "weight", "output", "input_x_weight", "output_x_weight")


@dataclass(frozen=True, kw_only=True, eq=False)
class Groups3D:
    """The 3D groups of this rank and its coordinates in the cube.

    Equality is identity: process groups have no value equality.
    """

    input: ProcessGroup
    """Ranks that all-gather the input (Colossal-AI's ``PARALLEL_3D_INPUT``)."""
    weight: ProcessGroup
    """Ranks that all-gather the weight (``PARALLEL_3D_WEIGHT``)."""
    output: ProcessGroup
    """Ranks that reduce-scatter the output (``PARALLEL_3D_OUTPUT``)."""
    input_x_weight: ProcessGroup
    """The plane of the input and weight lines (``PARALLEL_3D_INPUT_X_WEIGHT``)."""
    output_x_weight: ProcessGroup
    """The plane of the output and weight lines (``PARALLEL_3D_OUTPUT_X_WEIGHT``)."""
    tensor: ProcessGroup
    """The whole cube (``ParallelMode.TENSOR``)."""
    depth: int
    """The cube edge ``q``."""
    input_rank: int
    """This rank's index in :attr:`input`."""
    weight_rank: int
    """This rank's index in :attr:`weight`."""
    output_rank: int
    """This rank's index in :attr:`output`."""

    def __post_init__(self) -> None:
        for role in _ROLES:
            size = dist.get_world_size(getattr(self, role))
            expected = self.depth**2 if role.endswith("_x_weight") else self.depth
            if size != expected:
                raise ValueError(
                    f"Groups3D: the {role} group has {size} ranks, expected {expected} for a "
                    f"cube of edge {self.depth}."
                )
        if dist.get_world_size(self.tensor) != self.depth**3:
            raise ValueError(f"Groups3D: the tensor group must hold {self.depth**3} ranks.")

    def __deepcopy__(self, memo: dict[int, object]) -> Groups3D:
        return self  # immutable, and process groups cannot be copied

    @property
    def size(self) -> int:
        """Ranks in the cube, ``q**3``."""
        return self.depth**3

    def swapped(self) -> Groups3D:
        """The groups seen by the layer after a linear layer: input and output exchanged (the
        linear layer's output is laid out as its input with the two roles swapped)."""
        return replace(
            self,
            input=self.output,
            output=self.input,
            input_x_weight=self.output_x_weight,
            output_x_weight=self.input_x_weight,
            input_rank=self.output_rank,
            output_rank=self.input_rank,
        )


def build_groups_3d(tensor_size: int | None = None, backend: str | None = None) -> Groups3D:
    """Create the 3D groups over the default world and return this rank's.

    COLLECTIVE: every rank of the world must call it (it creates every group of every block).

    Args:
        tensor_size: ranks per cube (default: the world size).
        backend: backend of the new groups (default: the world's).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: ``tensor_size`` is not a cube or does not divide the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_groups_3d needs torch.distributed; call kolossos.launch(...) first."
        )
    world, me = dist.get_world_size(), dist.get_rank()
    size = world if tensor_size is None else tensor_size
    lists = cube_rank_lists(world, size)
    mine: dict[str, ProcessGroup] = {}
    for role, groups in lists.items():
        for ranks in groups:
            group = dist.new_group(ranks, backend=backend)  # SYNC POINT: all ranks, same order
            if me in ranks:
                assert group is not None
                mine[role] = group
    return Groups3D(
        **mine,
        depth=check_cube(size),
        input_rank=dist.get_rank(mine["input"]),
        weight_rank=dist.get_rank(mine["weight"]),
        output_rank=dist.get_rank(mine["output"]),
    )
