"""Moving between partitioned flat tensors and full per-parameter tensors.

Optimizer states (and fp32 master weights) live as one flat partition per group and rank. Saving
needs them per parameter, with the parameter's global shape: :func:`gather_span` assembles one
parameter from the ranks owning its pieces. Loading goes the other way without communication:
every rank holds the full per-parameter values and :class:`PartitionStateBuilder` cuts out its
slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kolossos.accelerator import get_accelerator
from kolossos.zero.low_level.comm import Communicator
from kolossos.zero.low_level.partition import FlatLayout, ParamSpan, intersect

__all__ = [
    "PartitionStateBuilder",
    "gather_span",
    "is_partitioned",
    "local_piece",
    "positional_groups",
]

#: p2p tags of checkpoint gathers (above any bucket index)
_TAG = 1 << 20


def is_partitioned(value: Any, partition: torch.Tensor) -> bool:
    """Whether an optimizer state value is laid out like the master partition (sliceable)."""
    return isinstance(value, torch.Tensor) and value.shape == partition.shape


def local_piece(layout: FlatLayout, rank: int, span: ParamSpan) -> tuple[int, int, int] | None:
    """The part of ``span`` this rank owns: ``(offset in partition, offset in param, numel)``."""
    start, stop = layout.partition_range(rank)
    piece = intersect((span.offset, span.stop), (start, stop))
    if piece is None:
        return None
    return piece[0] - start, piece[0] - span.offset, piece[1] - piece[0]


def _comm_ready(tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``tensor`` where the backend can send it (NCCL cannot move CPU tensors)."""
    if comm.gloo or tensor.device.type != "cpu":
        return tensor
    return tensor.to(get_accelerator().get_current_device())


def gather_span(
    comm: Communicator,
    layout: FlatLayout,
    partition: torch.Tensor,
    span: ParamSpan,
    dst: int | None,
) -> torch.Tensor | None:
    """Assemble one parameter's full tensor from the ranks' partitions of a flat tensor.

    A collective of the data-parallel group: every rank calls it with the same ``span``.

    Args:
        comm: the data-parallel communicator.
        layout: the group's layout.
        partition: this rank's partition of the flat tensor (``S`` elements).
        span: the parameter.
        dst: the rank that receives the result (point-to-point), or ``None`` for every rank.

    Returns:
        The parameter-shaped tensor on the receiving rank(s) (on ``partition``'s device), else
        ``None``.
    """
    receives = dst is None or comm.rank == dst
    out = torch.empty(span.numel, dtype=partition.dtype, device=partition.device)
    for owner, lo, hi in layout.owners(span.offset, span.stop):
        part_start, _ = layout.partition_range(owner)
        target = out[lo - span.offset : hi - span.offset]
        if comm.rank == owner:
            target.copy_(partition[lo - part_start : hi - part_start])
        if dst is None:
            buffer = _comm_ready(target, comm)
            comm.broadcast(buffer, owner)
            if buffer is not target:
                target.copy_(buffer)
        elif owner != dst and comm.rank in (owner, dst):
            buffer = _comm_ready(target, comm)
            if comm.rank == owner:
                dist.send(buffer, comm.global_rank(dst), comm.group, _TAG)
            else:
                dist.recv(buffer, comm.global_rank(owner), comm.group, _TAG)
                if buffer is not target:
                    target.copy_(buffer)
    return out.view(span.shape) if receives else None


class PartitionStateBuilder:
    """Builds one group's partition state from full per-parameter states, one at a time (so a
    checkpoint streams through without holding every full state).

    Tensors with the parameter's shape are cut to this rank's slice; anything else (``step``,
    scalars) is taken from the first parameter that has it, since one flat partition carries
    one value per group. Floating-point states take the master's dtype and device.

    Args:
        layout: the group's layout.
        rank: this rank.
        template: the master partition.
    """

    def __init__(self, layout: FlatLayout, rank: int, template: torch.Tensor) -> None:
        self.layout = layout
        self.rank = rank
        self.template = template
        self.state: dict[str, Any] = {}

    def add(self, index: int, state: Mapping[str, Any]) -> None:
        """Cut parameter ``index``'s full state into the partition state."""
        span = self.layout.spans[index]
        piece = local_piece(self.layout, self.rank, span)
        for key, value in state.items():
            sliceable = (
                isinstance(value, torch.Tensor)
                and tuple(value.shape) == span.shape
                and key != "step"  # a 0-dim parameter's step is not a per-element state
            )
            if sliceable:
                flat = self.state.get(key)
                if flat is None:
                    dtype = self.template.dtype if value.is_floating_point() else value.dtype
                    flat = self.state[key] = torch.zeros_like(self.template, dtype=dtype)
                if piece is not None:
                    at, off, n = piece
                    flat[at : at + n].copy_(value.reshape(-1)[off : off + n])
            elif key not in self.state:
                self.state[key] = value.clone() if isinstance(value, torch.Tensor) else value


def positional_groups(
    hyper: Sequence[Mapping[str, Any]], sizes: Sequence[int]
) -> list[dict[str, Any]]:
    """torch-style ``param_groups``: each group's hyper-parameters and consecutive positions."""
    groups, start = [], 0
    for entry, size in zip(hyper, sizes, strict=True):
        group = {k: v for k, v in entry.items() if k != "params"}
        group["params"] = list(range(start, start + size))
        start += size
        groups.append(group)
    return groups
