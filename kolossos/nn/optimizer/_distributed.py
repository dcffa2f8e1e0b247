"""What a ZeRO/tensor-parallel aware optimizer knows about each parameter it steps, and the sums
it takes across shards (``DistributedLamb``, ``DistributedAdaFactor``).

The layout follows Colossal-AI's ``setup_distributed`` contract:

* **Tensor parallelism**: the *working* parameter (the one the model computes with) may be a
  tensor-parallel shard, marked with a :class:`~kolossos.nn.layer.parallel_1d.sharding.TPShardSpec`
  (every kolossos 1D layer marks its weights). Statistics of the full tensor are sums over the
  spec's group.
* **ZeRO** (``is_zero``/``use_zero`` with a data-parallel group of more than one rank): the
  optimizer steps a flat 1D shard of each working parameter; ``shard_to_working_param`` maps
  ``id(shard)`` to the working parameter. The working parameter is flattened, zero-padded at the
  end to ``shard.numel() * dp_size`` elements, and data-parallel rank ``r`` holds elements
  ``[r * shard.numel(), (r + 1) * shard.numel())``; the padding must stay zero. Statistics are
  sums over the data-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor

from kolossos.cluster.collectives import comm_device
from kolossos.nn.layer.parallel_1d.sharding import TPShardSpec, get_tp_spec

__all__ = ["DistributedLayout", "ShardInfo", "all_reduce_sum"]


@dataclass(frozen=True)
class ShardInfo:
    """How the tensor an optimizer steps relates to the full parameter."""

    shape: tuple[int, ...]
    """Shape of the working parameter (the tensor-parallel shard, or the whole parameter)."""
    tp: TPShardSpec | None
    """The tensor-parallel layout of the working parameter, ``None`` if replicated."""
    offset: int = 0
    """ZeRO: first element of the flattened working parameter held by this shard."""
    valid: int | None = None
    """ZeRO: elements of the shard that are not padding; ``None`` without ZeRO."""

    @property
    def zero(self) -> bool:
        """Whether the stepped tensor is a ZeRO flat shard."""
        return self.valid is not None

    @property
    def full_numel(self) -> int:
        """Elements of the full (unsharded) parameter."""
        return math.prod(self.tp.full_shape if self.tp is not None else self.shape)


def all_reduce_sum(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t`` summed over ``group`` (COLLECTIVE), through the group's communication device."""
    device = comm_device(group)
    buf = t.to(device)
    dist.all_reduce(buf, group=group)
    return buf.to(t.device)


def _same_ranks(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


class DistributedLayout:
    """The :class:`ShardInfo` of each stepped tensor, and the groups to sum statistics over."""

    def __init__(self) -> None:
        self.tp_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        self.tp_size = 1
        self.dp_size = 1
        self.zero = False
        self.infos: dict[int, ShardInfo] = {}

    def setup(
        self,
        param_groups: list[dict[str, Any]],
        tp_group: dist.ProcessGroup | None,
        dp_group: dist.ProcessGroup | None,
        shard_to_working_param: Mapping[int, Tensor] | None,
        padding_map: Mapping[int, int] | None,
        zero: bool,
    ) -> None:
        """Record the layout of every parameter of ``param_groups`` (see the module docstring).

        Raises:
            ValueError: a ZeRO shard too small for its working parameter, a ``padding_map``
                entry that disagrees with the shard size, or a parameter's tensor-parallel
                group that is not ``tp_group``.
        """
        self.tp_group, self.dp_group = tp_group, dp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.zero = bool(zero) and self.dp_size > 1
        mapping = shard_to_working_param or {}
        dp_rank = dist.get_rank(dp_group) if self.zero else 0
        self.infos = {}
        for group in param_groups:
            for p in group["params"]:
                working = mapping.get(id(p), p)
                spec = get_tp_spec(working)
                if (
                    spec is not None
                    and tp_group is not None
                    and not _same_ranks(spec.group, tp_group)
                ):
                    raise ValueError(
                        f"a parameter of shape {tuple(working.shape)} is split over ranks "
                        f"{dist.get_process_group_ranks(spec.group)} but tp_group holds "
                        f"{dist.get_process_group_ranks(tp_group)}; pass its tensor-parallel group."
                    )
                info = ShardInfo(tuple(working.shape), spec)
                if self.zero:
                    info = self._zero_info(info, p, working, padding_map or {}, dp_rank)
                self.infos[id(p)] = info

    def _zero_info(
        self, info: ShardInfo, shard: Tensor, working: Tensor, padding: Mapping[int, int], rank: int
    ) -> ShardInfo:
        size, numel = shard.numel(), working.numel()
        if size * self.dp_size < numel:
            raise ValueError(
                f"ZeRO shard of {size} elements x {self.dp_size} ranks cannot hold a working "
                f"parameter of {numel}; map each flat shard to its own working parameter in "
                "shard_to_working_param."
            )
        expected = padding.get(id(shard), padding.get(id(working)))
        if expected is not None and expected != size * self.dp_size - numel:
            raise ValueError(
                f"padding_map says {expected} padding elements but a shard of {size} x "
                f"{self.dp_size} ranks pads a parameter of {numel} by "
                f"{size * self.dp_size - numel}."
            )
        offset = rank * size
        return ShardInfo(info.shape, info.tp, offset, max(0, min(size, numel - offset)))

    def info(self, p: Tensor) -> ShardInfo:
        """The layout of ``p`` (a whole, replicated parameter if setup never saw it)."""
        found = self.infos.get(id(p))
        return found if found is not None else ShardInfo(tuple(p.shape), None)

    def sum_over_shards(self, sums: Tensor, infos: list[ShardInfo]) -> Tensor:
        """Rows of ``sums`` (one per entry of ``infos``, summable statistics of the local
        shard) summed over the shards of the full parameter: the data-parallel group for ZeRO
        shards, then each tensor-parallel group for split parameters (COLLECTIVES: every rank
        of a group calls this with the same parameters, in the same order)."""
        if self.zero and any(i.zero for i in infos):
            rows = [k for k, i in enumerate(infos) if i.zero]
            sums = sums.clone()
            sums[rows] = all_reduce_sum(sums[rows], self.dp_group)
        groups: dict[int, tuple[dist.ProcessGroup, list[int]]] = {}
        for k, i in enumerate(infos):
            if i.tp is not None:
                groups.setdefault(id(i.tp.group), (i.tp.group, []))[1].append(k)
        for group, rows in groups.values():
            sums = sums.clone()
            sums[rows] = all_reduce_sum(sums[rows], group)
        return sums
