"""Colossal-AI's test-writing forms on several ranks: ``spawn(fn, nprocs=N, **kwargs)`` (with the
rank function's ``world_size``/``port`` in any position) and ``assert_equal_in_group``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import kolossos
from kolossos.testing import RankError, assert_equal_in_group, distributed, spawn


def _launch_and_report(rank: int, world_size: int, port: int) -> tuple[int, int]:
    kolossos.launch(
        config={}, rank=rank, world_size=world_size, host="localhost", port=port, verbose=False
    )
    return dist.get_rank(), dist.get_world_size()


def test_spawn_with_upstreams_nprocs_keyword_runs_two_ranks() -> None:
    assert spawn(_launch_and_report, nprocs=2) == [(0, 2), (1, 2)]


def _upstream_order(
    rank: int, model_cls: str, world_size: int, port: int, scale: int = 1
) -> tuple[int, str, int, int]:
    assert isinstance(port, int) and port > 0
    return rank, model_cls, world_size, scale


def test_spawn_passes_world_size_and_port_by_name_as_upstream() -> None:
    # upstream calls func(rank, world_size=..., port=..., **kwargs): rank functions may put
    # their own arguments before world_size and port
    out = spawn(_upstream_order, nprocs=2, model_cls="mlp", scale=3)
    assert out == [(0, "mlp", 2, 3), (1, "mlp", 2, 3)]


def _positional(rank: int, ws: int, p: int) -> int:
    return ws * 10 + rank


def test_spawn_positional_form_unchanged() -> None:
    assert spawn(_positional, 2) == [20, 21]
    assert spawn(_positional, nprocs=2) == [20, 21]


@distributed(2)
def test_assert_equal_in_group_passes_and_raises() -> None:
    rank = dist.get_rank()
    assert_equal_in_group(torch.arange(6.0).reshape(2, 3))
    group = dist.new_group([0, 1])
    assert_equal_in_group(torch.ones(3), process_group=group)
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] differ from rank 0"):
        assert_equal_in_group(torch.full((3,), float(rank)))
    with pytest.raises(AssertionError, match="shape/dtype differ"):
        assert_equal_in_group(torch.ones(rank + 1))
    with pytest.raises(AssertionError, match="shape/dtype differ"):
        assert_equal_in_group(torch.ones(2, dtype=torch.float64 if rank else torch.float32))


def _fails_on_rank_1(rank: int, world_size: int, port: int) -> None:
    if rank == 1:
        raise AssertionError("rank one disagrees")


def test_spawn_with_nprocs_reports_the_failing_rank() -> None:
    with pytest.raises(RankError, match="rank 1 of 2 failed") as info:
        spawn(_fails_on_rank_1, nprocs=2)
    assert "rank one disagrees" in str(info.value)
