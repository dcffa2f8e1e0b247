"""launch / launch_from_torch in real multi-process jobs (forked ranks over gloo)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import kolossos
from kolossos.initialize import get_launch_config
from kolossos.testing import RankError, distributed, spawn


def _documented_launch(rank: int, world_size: int, port: int) -> float:
    # The docs' form: explicit rank/world size/host/port and backend='nccl' (no CUDA here:
    # falls back to gloo with one warning).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kolossos.launch(
            config={},
            rank=rank,
            world_size=world_size,
            host="localhost",
            port=port,
            backend="nccl",
            verbose=False,
        )
    assert dist.get_backend() == "gloo"
    assert sum("nccl" in str(w.message) for w in caught) == 1
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


@pytest.mark.dist
def test_launch_all_reduce() -> None:
    assert spawn(_documented_launch, 4) == [10.0] * 4


def _from_torch(rank: int, world_size: int, port: int, config: object) -> int:
    kolossos.launch_from_torch(config=config, verbose=False)
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    assert get_launch_config() == config
    # same seed on every rank: identical initial weights
    weights = torch.nn.Linear(4, 4).weight.detach().clone()
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    assert all(torch.equal(w, weights) for w in gathered)
    return rank


@pytest.mark.dist
def test_launch_from_torch_reads_environment() -> None:
    assert spawn(_from_torch, 2, config={"BATCH_SIZE": 4}) == [0, 1]


@distributed(2)
def test_second_launch_is_checked() -> None:
    with pytest.warns(RuntimeWarning, match="already initialised"):
        kolossos.launch({}, dist.get_rank(), 2, "localhost", 1, verbose=False)
    with pytest.raises(RuntimeError, match="already initialised"):
        kolossos.launch({}, 0, 3, "localhost", 1, verbose=False)


def _collective_timeout(rank: int, world_size: int, port: int) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, verbose=False, timeout=2)
    if rank == 0:
        dist.barrier()  # rank 1 never joins: must end in an error, not a hang


@pytest.mark.dist
def test_lost_rank_surfaces_as_timeout_error() -> None:
    with pytest.raises(RankError, match=r"rank 0 of 2 failed") as err:
        spawn(_collective_timeout, 2, timeout=60)
    assert "barrier" in str(err.value).lower() or "timed out" in str(err.value).lower()
