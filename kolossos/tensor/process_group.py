"""``ProcessGroup``: Colossal-AI's tensor-parallel x data-parallel process layout of ColoTensor.

The processes form a ``(dp_degree, tp_degree)`` mesh, row-major: tensor-parallel groups sit on
the low, contiguous axis (neighbouring ranks, usually one node) and data-parallel groups on the
high one. With 8 processes, ``tp_degree=4, dp_degree=2``: tp groups ``{0,1,2,3}`` and
``{4,5,6,7}``, dp groups ``{0,4}``, ``{1,5}``, ... The mesh is a torch ``DeviceMesh`` with axes
``("dp", "tp")``; ColoTensors live on its ``"tp"`` sub-mesh.

Example:
    >>> pg = ProcessGroup(tp_degree=2, dp_degree=2)  # doctest: +SKIP
    >>> pg.tp_world_size(), pg.tp_rank_list()  # on rank 1  # doctest: +SKIP
    (2, [0, 1])
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kolossos.accelerator import get_accelerator

__all__ = ["ProcessGroup"]


def _degrees(tp: int | None, dp: int | None, world: int) -> tuple[int, int]:
    for name, value in (("tp_degree", tp), ("dp_degree", dp)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"ProcessGroup({name}={value!r}): must be a positive int or None.")
    if tp is None and dp is None:
        tp, dp = 1, world
    elif tp is None:
        assert dp is not None
        tp = world // dp
    elif dp is None:
        dp = world // tp
    if tp * dp != world:
        raise ValueError(
            f"ProcessGroup(tp_degree={tp}, dp_degree={dp}) holds {tp * dp} processes but the "
            f"world size is {world}; choose degrees whose product is the world size."
        )
    return tp, dp


class ProcessGroup:
    """The tensor-parallel and data-parallel groups of this process.

    Args:
        rank: this process's global rank (default: ``torch.distributed.get_rank()``).
        ranks: the global ranks of the layout (default: all; only the whole world is supported).
        tp_degree: size of each tensor-parallel group (default: ``world // dp_degree``, or 1).
        dp_degree: size of each data-parallel group (default: ``world // tp_degree``).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: degrees whose product is not the world size, or a ``rank`` that is not this
            process's.
        NotImplementedError: ``ranks`` other than the whole world.
    """

    def __init__(
        self,
        rank: int | None = None,
        ranks: list[int] | None = None,
        tp_degree: int | None = None,
        dp_degree: int | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroup needs torch.distributed; call kolossos.launch(...) or "
                "kolossos.launch_from_torch() first."
            )
        world = dist.get_world_size()
        if ranks is not None and sorted(ranks) != list(range(world)):
            raise NotImplementedError(
                f"ProcessGroup(ranks={ranks}) over a subset of the world is not supported; "
                "omit ranks (the layout covers every process)."
            )
        if rank is not None and rank != dist.get_rank():
            raise ValueError(
                f"ProcessGroup(rank={rank}) is not this process's rank {dist.get_rank()}."
            )
        self._tp, self._dp = _degrees(tp_degree, dp_degree, world)
        self._rank = dist.get_rank()
        # SYNC POINT: creates one group per mesh axis, on every rank in the same order
        self._mesh = init_device_mesh(
            get_accelerator().name, (self._dp, self._tp), mesh_dim_names=("dp", "tp")
        )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The torch ``(dp, tp)`` device mesh."""
        return self._mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-d tensor-parallel sub-mesh of this process (where ColoTensors live)."""
        return self._mesh["tp"]

    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def ranks(self) -> list[int]:
        """All global ranks of the layout."""
        return list(range(self._tp * self._dp))

    def world_size(self) -> int:
        """The number of processes."""
        return self._tp * self._dp

    def tp_world_size(self) -> int:
        """The size of a tensor-parallel group."""
        return self._tp

    def dp_world_size(self) -> int:
        """The size of a data-parallel group."""
        return self._dp

    def tp_local_rank(self) -> int:
        """This process's rank in its tensor-parallel group."""
        return self._rank % self._tp

    def dp_local_rank(self) -> int:
        """This process's rank in its data-parallel group."""
        return self._rank // self._tp

    def tp_rank_list(self) -> list[int]:
        """The global ranks of this process's tensor-parallel group."""
        start = self._rank - self.tp_local_rank()
        return list(range(start, start + self._tp))

    def dp_rank_list(self) -> list[int]:
        """The global ranks of this process's data-parallel group."""
        return list(range(self.tp_local_rank(), self.world_size(), self._tp))

    def tp_process_group(self) -> dist.ProcessGroup:
        """This process's tensor-parallel ``torch.distributed`` group."""
        return self._mesh.get_group("tp")

    def dp_process_group(self) -> dist.ProcessGroup:
        """This process's data-parallel ``torch.distributed`` group."""
        return self._mesh.get_group("dp")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessGroup) and (self._tp, self._dp) == (other._tp, other._dp)

    def __hash__(self) -> int:
        return hash((self._tp, self._dp))

    def __repr__(self) -> str:
        return f"ProcessGroup(tp_degree={self._tp}, dp_degree={self._dp}, rank={self._rank})"
