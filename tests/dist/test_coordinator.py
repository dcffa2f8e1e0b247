"""DistCoordinator: rank facts, priority execution, master-only helpers."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from kolossos.cluster import DistCoordinator
from kolossos.cluster.dist_coordinator import priority_execution
from kolossos.testing import distributed


@distributed(3)
def test_coordinator_facts(capfd: object) -> None:
    c = DistCoordinator()
    rank = dist.get_rank()
    assert (c.rank, c.world_size, c.local_rank) == (rank, 3, rank)
    assert c.is_master() == (rank == 0)
    assert c.is_node_master() == (rank == 0)
    assert c.is_last_process() == (rank == 2)

    @c.on_master_only()
    def answer() -> int:
        return 42

    assert answer() == (42 if rank == 0 else None)
    c.block_all()


@distributed(3)
def test_priority_execution_orders_ranks(tmp_path: Path) -> None:
    log = tmp_path / "order.txt"
    rank = dist.get_rank()
    with priority_execution():  # the module-level form the docs import
        if rank == 0:
            time.sleep(0.3)  # a slow "download": the others must still wait for it
        with log.open("a") as f:
            f.write(f"{rank}\n")
    dist.barrier()
    order = log.read_text().split()
    assert order[0] == "0" and sorted(order) == ["0", "1", "2"]


def test_coordinator_without_process_group() -> None:
    c = DistCoordinator()
    assert (c.rank, c.world_size) == (0, 1) and c.is_master() and c.is_last_process()
    with c.priority_execution():
        pass
