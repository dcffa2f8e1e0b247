"""The multi-process harness itself: results, failures named by rank, timeouts, no orphans."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from kolossos.testing import (
    RankError,
    distributed,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
    spawn,
)


def _rank_value(rank: int, world_size: int, port: int, scale: int) -> int:
    return rank * scale + world_size


def test_spawn_returns_rank_results() -> None:
    assert spawn(_rank_value, 3, scale=10) == [3, 13, 23]


def _fails_on_one(rank: int, world_size: int, port: int) -> None:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(30)  # the survivors must be killed, not waited for


def test_failure_names_rank_and_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 3 failed") as err:
        spawn(_fails_on_one, 3)
    assert "ValueError: rank one is unhappy" in str(err.value)
    assert err.value.rank == 1
    assert time.monotonic() - start < 15


def _dies(rank: int, world_size: int, port: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(30)


def test_rank_that_dies_is_reported() -> None:
    with pytest.raises(RankError, match=r"rank 0 of 2 failed[\s\S]*exit code 3"):
        spawn(_dies, 2)


def _hangs(rank: int, world_size: int, port: int, marker: str) -> None:
    if rank == 1:
        time.sleep(60)


def test_timeout_reports_stacks_and_leaves_no_process() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RankError, match=r"timed out after 2 s waiting for rank\(s\) \[1\]") as err:
        spawn(_hangs, 2, timeout=2, marker="x")
    assert "_hangs" in str(err.value)  # the hung rank's Python stack
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


@distributed(2)
def test_distributed_decorator_initialises_group() -> None:
    assert dist.is_initialized() and dist.get_world_size() == 2
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), 2.0))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@distributed()
def test_distributed_world_size_from_parametrize(world_size: int) -> None:
    assert dist.get_world_size() == world_size


@distributed(2)
def test_parameterize_sweeps_inside_one_group() -> None:
    seen: list[tuple[int, str]] = []

    @parameterize("n", [1, 2])
    @parameterize("mode", ["a", "b"])
    def body(n: int, mode: str) -> None:
        seen.append((n, mode))

    body()
    assert seen == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]


def test_rerun_helpers() -> None:
    calls = {"n": 0}

    @rerun_if_address_is_in_use(max_try=3)
    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 3:
            raise RuntimeError("bind: Address already in use")
        return "ok"

    assert flaky() == "ok" and calls["n"] == 3

    @rerun_on_exception(ValueError, pattern="retry me", max_try=5)
    def other() -> None:
        raise ValueError("do not retry")

    with pytest.raises(ValueError, match="do not retry"):
        other()


def test_distributed_needs_world_size() -> None:
    with pytest.raises(TypeError, match="world_size"):

        @distributed()
        def test_nothing() -> None:
            pass
