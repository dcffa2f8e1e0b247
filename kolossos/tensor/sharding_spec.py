"""``ShardingSpec``: how each dimension of a tensor is cut over the axes of an N-d device mesh.

The notation is Colossal-AI's: one entry per tensor dimension, ``R`` (replicated) or ``S`` followed
by the mesh axes that cut that dimension, outer axis first. On a 2 x 2 mesh ``S0RR`` cuts dimension
0 of a 3-d tensor in two along mesh axis 0 and keeps it whole along axis 1; ``RS01R`` cuts
dimension 1 in four, first along axis 0, then each half again along axis 1. The same spec is a
``dim_partition_dict``: ``{1: [0, 1]}`` for ``RS01R``.

The similarity function :meth:`ShardingSpec.spec_diff` is the heuristic of the layout converter's
greedy search (docs: "the one with the least difference to the target"): per tensor dimension,
the cost of the cheapest sequence of single steps that turns the source's axis list into the
target's (drop trailing axes by all-gathers, then append axes by shards), with a penalty per extra
step; the dimensions' costs add up. On a 2-d mesh it gives, e.g., ``S0 -> R`` 20, ``R -> S0`` 5,
``S0 -> S1`` 31, ``R -> S01`` 16.

Example:
    >>> spec = ShardingSpec.from_notation("S01RR")
    >>> spec.dim_partition_dict
    {0: [0, 1]}
    >>> str(spec), spec.spec_diff(ShardingSpec.from_notation("RS01R"))
    ('S01RR', 62)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = [
    "ALLGATHER_COST",
    "SHARD_COST",
    "STEP_PENALTY",
    "ShardingSpec",
    "convert_dim_partition_dict",
    "dim_difference",
    "merge_same_dim_mesh_list",
]

#: heuristic cost of one all-gather in the similarity function (Colossal-AI's weights)
ALLGATHER_COST = 20
#: heuristic cost of one local shard (no communication) in the similarity function
SHARD_COST = 5
#: heuristic cost of each step beyond the first in one dimension's conversion
STEP_PENALTY = 6

_TOKEN = re.compile(r"R|S_?\{?(\d+)\}?")


def dim_difference(source: Sequence[int], target: Sequence[int]) -> int:
    """Heuristic distance from one dimension's mesh-axis list to another's.

    The cheapest conversion keeps the longest common prefix, all-gathers the source's remaining
    axes (last first) and then shards the target's remaining axes (first first).

    Example:
        >>> dim_difference([0], []), dim_difference([], [0, 1]), dim_difference([1], [0, 1])
        (20, 16, 42)
    """
    common = 0
    while common < min(len(source), len(target)) and source[common] == target[common]:
        common += 1
    gathers, shards = len(source) - common, len(target) - common
    steps = gathers + shards
    if steps == 0:
        return 0
    return gathers * ALLGATHER_COST + shards * SHARD_COST + (steps - 1) * STEP_PENALTY


def convert_dim_partition_dict(
    dim_size: int, dim_partition_dict: Mapping[int, Sequence[int]]
) -> dict[int, list[int]]:
    """The partition dict with negative tensor dimensions made non-negative and empty entries
    dropped, keys in increasing order.

    Raises:
        ValueError: a dimension outside ``[-dim_size, dim_size)`` or repeated after normalising.
    """
    out: dict[int, list[int]] = {}
    for dim, axes in dim_partition_dict.items():
        if not -dim_size <= dim < dim_size:
            raise ValueError(
                f"sharding dimension {dim} is out of range for a {dim_size}-d tensor; use a "
                f"dimension in [{-dim_size}, {dim_size})."
            )
        norm = dim % dim_size
        if norm in out:
            raise ValueError(f"tensor dimension {norm} is given twice (as {dim}); give it once.")
        if axes:
            out[norm] = [int(a) for a in axes]
    return dict(sorted(out.items()))


def merge_same_dim_mesh_list(
    dim_size: int, dim_partition_dict: Mapping[int, Sequence[int]]
) -> dict[int, list[int]]:
    """Like :func:`convert_dim_partition_dict`, but a dimension given both as ``d`` and
    ``d - dim_size`` has its mesh-axis lists concatenated (Colossal-AI's helper).

    Example:
        >>> merge_same_dim_mesh_list(3, {-1: [1], 2: [0]})
        {2: [1, 0]}
    """
    out: dict[int, list[int]] = {}
    for dim, axes in dim_partition_dict.items():
        if not -dim_size <= dim < dim_size:
            raise ValueError(f"sharding dimension {dim} is out of range for a {dim_size}-d tensor.")
        out.setdefault(dim % dim_size, []).extend(int(a) for a in axes)
    return {d: a for d, a in sorted(out.items()) if a}


class ShardingSpec:
    """The sharding of a ``dim_size``-d tensor over the axes of a device mesh.

    Give ``dim_partition_dict`` (tensor dim -> mesh axes, outer first) or ``sharding_sequence``
    (one entry per dimension: ``"R"``, ``"S0"``, ``"S01"``, or a list of axes). Instances are
    immutable and hashable; equal specs compare equal.

    Args:
        dim_size: number of tensor dimensions.
        dim_partition_dict: tensor dimension -> the mesh axes that cut it.
        sharding_sequence: the per-dimension notation instead of the dict.

    Raises:
        ValueError: both or neither form given, a bad token, or a mesh axis used twice.

    Example:
        >>> ShardingSpec(3, {1: [0, 1]}).sharding_sequence
        ['R', 'S01', 'R']
    """

    def __init__(
        self,
        dim_size: int,
        dim_partition_dict: Mapping[int, Sequence[int]] | None = None,
        sharding_sequence: Sequence[str | Sequence[int]] | None = None,
    ) -> None:
        if (dim_partition_dict is None) == (sharding_sequence is None):
            raise ValueError(
                "ShardingSpec needs exactly one of dim_partition_dict and sharding_sequence "
                f"(got {dim_partition_dict!r} and {sharding_sequence!r})."
            )
        if isinstance(dim_size, bool) or not isinstance(dim_size, int) or dim_size < 0:
            raise ValueError(f"ShardingSpec: dim_size={dim_size!r} must be an int >= 0.")
        if sharding_sequence is not None:
            if len(sharding_sequence) != dim_size:
                raise ValueError(
                    f"sharding_sequence {list(sharding_sequence)} has {len(sharding_sequence)} "
                    f"entries for a {dim_size}-d tensor; give one per dimension."
                )
            dim_partition_dict = {i: _axes_of(e) for i, e in enumerate(sharding_sequence)}
        assert dim_partition_dict is not None
        self.dims = dim_size
        self._partition = convert_dim_partition_dict(dim_size, dim_partition_dict)
        used = [a for axes in self._partition.values() for a in axes]
        if len(used) != len(set(used)) or any(a < 0 for a in used):
            raise ValueError(
                f"ShardingSpec {self._partition}: each mesh axis (>= 0) may cut at most one "
                "tensor dimension, once."
            )

    @classmethod
    def from_notation(cls, notation: str) -> ShardingSpec:
        """Parse ``"S0RR"``, ``"RS01R"``, ``"S_{01}RR"`` or ``"[S0, R, R]"`` (one digit per axis).

        Raises:
            ValueError: the string is not in the notation.
        """
        text = re.sub(r"[\s,\[\]$]", "", notation)
        entries: list[list[int]] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None:
                raise ValueError(
                    f"sharding notation {notation!r}: cannot read {text[pos:]!r}; write one of R, "
                    "S0, S1, S01, ... per tensor dimension, e.g. 'S0RR' or 'RS01R'."
                )
            entries.append([int(c) for c in match.group(1)] if match.group(1) else [])
            pos = match.end()
        return cls(len(entries), sharding_sequence=entries)

    @property
    def dim_partition_dict(self) -> dict[int, list[int]]:
        """Tensor dimension -> the mesh axes that cut it (a copy; replicated dims absent)."""
        return {d: list(a) for d, a in self._partition.items()}

    @property
    def sharding_sequence(self) -> list[str]:
        """One entry per dimension: ``"R"`` or ``"S"`` + the axes, e.g. ``['S0', 'R']``."""
        return [_token(self._partition.get(d, [])) for d in range(self.dims)]

    def axes_of(self, dim: int) -> list[int]:
        """The mesh axes that cut tensor dimension ``dim`` (empty: replicated)."""
        return list(self._partition.get(dim % self.dims if self.dims else dim, []))

    def used_axes(self) -> set[int]:
        """The mesh axes this spec shards along."""
        return {a for axes in self._partition.values() for a in axes}

    def is_replicated(self) -> bool:
        """Whether no dimension is cut."""
        return not self._partition

    def spec_diff(self, other: ShardingSpec) -> int:
        """The similarity function: heuristic distance from this spec to ``other`` (0: equal).

        Raises:
            ValueError: the specs are for tensors of different dimensionality.
        """
        if other.dims != self.dims:
            raise ValueError(
                f"cannot compare a {self.dims}-d spec {self} with a {other.dims}-d {other}."
            )
        return sum(dim_difference(self.axes_of(d), other.axes_of(d)) for d in range(self.dims))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardingSpec) and (self.dims, self._partition) == (
            other.dims,
            other._partition,
        )

    def __hash__(self) -> int:
        return hash((self.dims, tuple((d, tuple(a)) for d, a in self._partition.items())))

    def __str__(self) -> str:
        return "".join(self.sharding_sequence)

    def __repr__(self) -> str:
        return f"ShardingSpec({self})"


def _axes_of(entry: str | Sequence[int]) -> list[int]:
    if isinstance(entry, str):
        text = entry.replace("_", "").replace("{", "").replace("}", "")
        if text == "R":
            return []
        if re.fullmatch(r"S\d+", text) is None:
            raise ValueError(
                f"sharding entry {entry!r} must be 'R' or 'S' + mesh axes, e.g. 'S01'."
            )
        return [int(c) for c in text[1:]]
    return [int(a) for a in entry]


def _token(axes: Sequence[int]) -> str:
    return "S" + "".join(str(a) for a in axes) if axes else "R"
