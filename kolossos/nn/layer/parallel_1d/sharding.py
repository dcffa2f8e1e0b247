"""How a tensor-parallel parameter is cut: :class:`TPShardSpec`, attached to the parameter.

A 1D tensor-parallel layer keeps one shard of each weight. The spec records how the full tensor
maps onto the shards so checkpoint IO, gradient clipping and optimizer-state gathering can rebuild
the full tensor (:func:`gather_tp_full`) or cut a rank's shard from it (:func:`slice_tp_shard`)
without knowing which layer the parameter belongs to. The spec satisfies the mode-independent
:class:`~kolossos.nn.layer.shard_layout.ShardLayout` (``gather`` / ``shard`` / ``replicas``).

The full tensor is split evenly along ``dim`` over the ranks of ``group``. Two refinements:

* ``fused_sections``: the full tensor is several blocks stacked along ``dim`` (q, k and v of
  GPT-2's ``c_attn``); each block is split evenly and a rank's shard is its piece of every block,
  in block order.
* ``padded``: rows appended along ``dim`` before splitting (a vocabulary padded to a multiple of
  the group size); they are zeros, belong to the last ranks, and are stripped when gathering.

Example:
    >>> spec = get_tp_spec(layer.weight)  # doctest: +SKIP
    >>> full = gather_tp_full(layer.weight.detach(), spec)  # COLLECTIVE  # doctest: +SKIP
    >>> shard = slice_tp_shard(full, spec, dist.get_rank(spec.group))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._comm import all_gather_flat

__all__ = [
    "TPShardSpec",
    "gather_tp_full",
    "get_tp_spec",
    "is_sequence_parallel",
    "mark_sequence_parallel",
    "set_tp_spec",
    "slice_tp_shard",
    "tp_shard_pieces",
]

_SPEC_ATTR = "_kolossos_tp_spec"
_SP_ATTR = "_kolossos_sequence_parallel"
MARK_ATTRS = (_SPEC_ATTR, _SP_ATTR)
"""Tensor attributes this module sets. They live on the ``Parameter`` object: torch's
``Parameter.__deepcopy__`` and ``load_state_dict(assign=True)`` drop them, which the 1D layers
compensate for; on other modules, mark again after copying or replacing parameters."""


@dataclass(frozen=True, kw_only=True, eq=False)
class TPShardSpec:
    """The layout of one tensor-parallel shard.

    Equality is identity (``eq=False``): specs hold a process group, which has no value equality.
    """

    dim: int
    """Dimension of the full tensor that is split (non-negative)."""
    full_shape: tuple[int, ...]
    """Shape of the full tensor, without padding."""
    fused_sections: tuple[int, ...] | None = None
    """Sizes of the fused blocks along ``dim`` in the full tensor (sum = ``full_shape[dim]``),
    each split evenly over the ranks; ``None`` for one block."""
    padded: int = 0
    """Zero rows appended at the end of ``dim`` before splitting (vocabulary padding)."""
    group: ProcessGroup
    """The tensor-parallel process group the tensor is split over."""

    def __post_init__(self) -> None:
        ndim = len(self.full_shape)
        if not 0 <= self.dim < ndim:
            raise ValueError(
                f"TPShardSpec dim={self.dim} must lie in [0, {ndim}) for full_shape "
                f"{self.full_shape}; pass the non-negative index of the split dimension."
            )
        if self.padded < 0:
            raise ValueError(f"TPShardSpec padded={self.padded} must be >= 0.")
        world = dist.get_world_size(self.group)
        length = self.full_shape[self.dim]
        if self.fused_sections is not None:
            if self.padded:
                raise ValueError(
                    f"TPShardSpec: padded={self.padded} cannot be combined with fused_sections "
                    f"{self.fused_sections}; pad each block yourself or use one block."
                )
            if sum(self.fused_sections) != length or any(
                s <= 0 or s % world for s in self.fused_sections
            ):
                raise ValueError(
                    f"TPShardSpec fused_sections={self.fused_sections} must be positive, sum to "
                    f"full_shape[{self.dim}]={length} and each be divisible by the group size "
                    f"{world}."
                )
        elif (length + self.padded) % world:
            raise ValueError(
                f"TPShardSpec: full_shape[{self.dim}]={length} plus padded={self.padded} is not "
                f"divisible by the tensor-parallel size {world}; pad the dimension to a multiple."
            )

    def __deepcopy__(self, memo: dict[int, object]) -> TPShardSpec:
        return self  # immutable, and its process group cannot be copied

    @property
    def world_size(self) -> int:
        """Number of ranks in :attr:`group`."""
        return dist.get_world_size(self.group)

    def shard_shape(self) -> tuple[int, ...]:
        """The shape of each rank's shard (all shards have the same shape)."""
        shape = list(self.full_shape)
        shape[self.dim] = (shape[self.dim] + self.padded) // self.world_size
        return tuple(shape)

    # -- the ShardLayout contract (kolossos.nn.layer.shard_layout) --------------------------
    @property
    def replicas(self) -> int:
        """Ranks of :attr:`group` holding each element: 1 (each element lives on one rank)."""
        return 1

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """:func:`gather_tp_full` of ``local``. COLLECTIVE over :attr:`group`."""
        return gather_tp_full(local, self)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full`` (:func:`slice_tp_shard`); no communication."""
        return slice_tp_shard(full, self, dist.get_rank(self.group))


def set_tp_spec(param: torch.Tensor, spec: TPShardSpec) -> None:
    """Attach ``spec`` to ``param`` (a parameter holding this rank's shard).

    Raises:
        ValueError: ``param``'s shape is not the shard shape the spec describes.
    """
    if tuple(param.shape) != spec.shard_shape():
        raise ValueError(
            f"set_tp_spec: parameter of shape {tuple(param.shape)} does not match the shard shape "
            f"{spec.shard_shape()} of full_shape {spec.full_shape} split along dim {spec.dim}."
        )
    setattr(param, _SPEC_ATTR, spec)


def get_tp_spec(tensor: torch.Tensor) -> TPShardSpec | None:
    """The :class:`TPShardSpec` attached to ``tensor``, or ``None`` for a replicated tensor."""
    spec = getattr(tensor, _SPEC_ATTR, None)
    return spec if isinstance(spec, TPShardSpec) else None


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """Mark a replicated parameter used on sequence shards (LayerNorm weights and the row-parallel
    bias under sequence parallelism): each rank's gradient covers only its part of the sequence,
    so gradients must be summed over the tensor-parallel group before the optimizer step."""
    setattr(param, _SP_ATTR, True)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Whether :func:`mark_sequence_parallel` marked ``param``."""
    return bool(getattr(param, _SP_ATTR, False))


def _blocks(spec: TPShardSpec) -> tuple[int, ...]:
    """Block sizes along ``dim`` in the (padded) full tensor."""
    if spec.fused_sections is not None:
        return spec.fused_sections
    return (spec.full_shape[spec.dim] + spec.padded,)


def gather_tp_full(tensor: torch.Tensor, spec: TPShardSpec) -> torch.Tensor:
    """Rebuild the full tensor from every rank's shard, padding stripped.

    COLLECTIVE over ``spec.group``: every rank of the group must call it in the same order.

    Args:
        tensor: this rank's shard (a parameter, its gradient, or an optimizer state of the same
            shape).
        spec: the parameter's :class:`TPShardSpec`.

    Returns:
        A new tensor of shape ``spec.full_shape`` on ``tensor``'s device.
    """
    if tuple(tensor.shape) != spec.shard_shape():
        raise ValueError(
            f"gather_tp_full: tensor of shape {tuple(tensor.shape)} is not a shard of "
            f"{spec.full_shape} (expected {spec.shard_shape()})."
        )
    world = spec.world_size
    local = tensor.detach().contiguous()
    flat = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    # SYNC POINT: flat output; gloo cannot gather into a stacked 2-D tensor.
    all_gather_flat(flat, local.view(-1), spec.group)
    shards = flat.view(world, *local.shape).unbind(0)
    pieces: list[torch.Tensor] = []
    split_sizes = [size // world for size in _blocks(spec)]
    per_rank = [shard.split(split_sizes, dim=spec.dim) for shard in shards]
    for block in range(len(split_sizes)):
        pieces.extend(parts[block] for parts in per_rank)
    full = torch.cat(pieces, dim=spec.dim)
    return full.narrow(spec.dim, 0, spec.full_shape[spec.dim]).contiguous()


def slice_tp_shard(full: torch.Tensor, spec: TPShardSpec, rank: int) -> torch.Tensor:
    """Cut the shard of ``rank`` (its rank in ``spec.group``) out of ``full``; no communication.

    Padding rows, if any, are zeros.

    Raises:
        ValueError: ``full`` does not have ``spec.full_shape`` or ``rank`` is out of range.
    """
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(
            f"slice_tp_shard: tensor of shape {tuple(full.shape)} is not the full shape "
            f"{spec.full_shape} the spec describes."
        )
    world = spec.world_size
    if not 0 <= rank < world:
        raise ValueError(f"slice_tp_shard: rank={rank} must lie in [0, {world}).")
    if spec.padded:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padded
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    blocks = full.split(list(_blocks(spec)), dim=spec.dim)
    mine = [block.chunk(world, dim=spec.dim)[rank] for block in blocks]
    return torch.cat(mine, dim=spec.dim).contiguous()


def tp_shard_pieces(spec: TPShardSpec, rank: int) -> tuple[list[tuple[int, int, int]], int]:
    """Where the shard of ``rank`` lies in the full tensor: ``(dim, start, stop)`` ranges to
    concatenate along ``spec.dim``, and the number of padding rows to append — what
    :func:`slice_tp_shard` cuts, as ranges a checkpoint reader can read directly."""
    world, dim, length = spec.world_size, spec.dim, spec.full_shape[spec.dim]
    pieces, pad, start = [], 0, 0
    for block in _blocks(spec):
        per = block // world
        lo, hi = start + rank * per, start + (rank + 1) * per
        stored_hi = min(hi, length)
        if stored_hi > lo:
            pieces.append((dim, lo, stored_hi))
        pad += hi - max(lo, stored_hi)
        start += block
    return pieces, pad
