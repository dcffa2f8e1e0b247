"""Shared segments between the ranks of a gloo group (``kolossos/cluster/host_shm.py``) and ZeRO's
transfers through them (``kolossos/zero/low_level/shm_transport.py``)."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kolossos.cluster import host_shm
from kolossos.cluster.host_shm import SHM_ENV, open_host_segments
from kolossos.testing import distributed
from kolossos.utils.profiling import CommCounter
from kolossos.zero.low_level.comm import Communicator

PAGE = 4096


@distributed(3)
def test_every_rank_reads_what_each_wrote_and_released_pages_read_zero() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    segments = open_host_segments(None, 4 * PAGE)
    assert segments is not None, "the ranks share a host and /dev/shm: segments expected"
    assert os.fstat(segments._fd).st_nlink == 0, "the file must be unlinked once mapped"
    segments.reserve(PAGE, 2 * PAGE)
    mine = segments.view(rank, PAGE, 2 * PAGE // 4, torch.float32)
    mine.copy_(torch.arange(mine.numel(), dtype=torch.float32) + 1000 * rank)
    dist.barrier()
    for peer in range(world):
        seen = segments.view(peer, PAGE, 2 * PAGE // 4, torch.float32)
        expected = torch.arange(seen.numel(), dtype=torch.float32) + 1000 * peer
        assert torch.equal(seen, expected), f"rank {rank} reading rank {peer}"
    dist.barrier()
    segments.release(PAGE, 2 * PAGE)
    dist.barrier()
    for peer in range(world):
        assert not segments.view(peer, PAGE, 2 * PAGE // 4, torch.float32).any()
    del mine, seen
    segments.close()


@distributed(2)
def test_one_rank_opting_out_or_another_host_means_none_everywhere(monkeypatch: Any) -> None:
    rank = dist.get_rank()
    if rank == 1:
        monkeypatch.setenv(SHM_ENV, "0")
    assert open_host_segments(None, PAGE) is None
    monkeypatch.delenv(SHM_ENV, raising=False)
    monkeypatch.setattr(host_shm, "_host_identity", lambda: (f"host{rank}", "boot"))
    assert open_host_segments(None, PAGE) is None
    monkeypatch.undo()
    segments = open_host_segments(None, PAGE)
    assert segments is not None  # the same call without the two obstacles shares memory
    segments.close()


@distributed(2)
def test_a_full_dev_shm_is_a_clear_error(monkeypatch: Any) -> None:
    segments = open_host_segments(None, PAGE)
    assert segments is not None

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RuntimeError, match=rf"no room.*{SHM_ENV}=0"):
        segments.reserve(0, PAGE)
    segments.close()


@pytest.mark.parametrize("world_size", [2, 3, 4])
@distributed()
def test_gather_and_reduce_through_slots_match_the_exact_sums(world_size: int) -> None:
    """Partitions larger than a slot go in pieces (two slots, seven pieces); buckets from
    every rank add up at their owner whatever slots the senders used."""
    rank = dist.get_rank()
    comm = Communicator(None)
    comm.share_memory(slots=2, slot_bytes=PAGE)
    assert comm.shared is not None
    size = 7 * PAGE // 4 - 3  # elements per partition: seven pieces, the last one short
    flat = torch.full((world_size * size,), -1.0)
    flat[rank * size : (rank + 1) * size] = torch.arange(size) + 10_000.0 * rank
    with CommCounter() as counted:
        comm.gather_partitions(flat).wait()
    assert counted.bytes("all_gather") == flat.numel() * 4  # counted though no socket carried it
    expected = torch.cat([torch.arange(size) + 10_000.0 * r for r in range(world_size)])
    assert torch.equal(flat, expected)
    numel = PAGE // 4
    handles, results = [], {}
    counted = CommCounter().__enter__()
    for bucket in range(3 * world_size):  # more buckets than slots: senders wait in order
        owner = bucket % world_size
        part = torch.full((numel,), float(rank + 1)) * (bucket + 1)
        if owner != rank:
            while not comm.can_send(part):
                handles.pop(0).wait()  # the oldest bucket first, as the reducer does
        handles.append(comm.reduce_to_owner(part, owner, bucket))
        if owner == rank:
            results[bucket] = part
    for handle in handles:
        handle.wait()
    comm.release_buffers()
    counted.__exit__(None, None, None)
    # each non-owned bucket's payload, plus the 8-byte slot numbers and answers that gloo carried
    data, control = 3 * (world_size - 1) * numel * 4, 2 * 3 * (world_size - 1) * 8
    assert counted.bytes("send") == data + control
    assert counted.bytes("recv") == data + control
    total = world_size * (world_size + 1) / 2
    for bucket, part in results.items():
        assert torch.equal(part, torch.full((numel,), total * (bucket + 1))), bucket
