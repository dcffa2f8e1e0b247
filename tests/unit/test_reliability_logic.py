"""The pure logic behind the watchdog, the flight-recorder report and job restarts: who is behind,
what the table says, which watchdog values are accepted, which nodes a restart keeps."""

from __future__ import annotations

import dataclasses

import pytest

from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.hostfile import HostEntry
from kolossos.cli.launcher.plan import LaunchPlan
from kolossos.cli.launcher.restarts import live_hosts
from kolossos.cluster.flight_recorder import (
    LastCollective,
    describe,
    enable,
    from_dict,
    stragglers,
    to_dict,
)
from kolossos.launch_env import parse_watchdog, watchdog_seconds


def _last(group: str, seq: int, kind: str = "gloo:all_reduce", ranks: tuple[int, ...] = (0, 1)):
    return LastCollective(group, list(ranks), seq, kind, 100.0 if seq else 0.0, "scheduled")


def test_the_rank_that_never_entered_the_leaders_collective_is_behind() -> None:
    every = {
        0: {"default_pg#0": _last("default_pg#0", 7), "tp#1": _last("tp#1", 3)},
        1: {"default_pg#0": _last("default_pg#0", 6), "tp#1": _last("tp#1", 3)},
        2: {"default_pg#0": _last("default_pg#0", 7)},
    }
    behind = stragglers(every)
    assert list(behind) == [1]
    assert behind[1].startswith("rank 0 started collective #7 (gloo:all_reduce) of group")
    assert behind[1].endswith("which rank 1 never entered (its last there: #6)")
    table = describe(every, now=110.0)
    assert "rank 1: #6 gloo:all_reduce, started 10.0 s ago   <- behind" in table
    assert "rank 0: #7 gloo:all_reduce, started 10.0 s ago\n" in table
    assert table.endswith("rank 1 is behind: " + behind[1])


def test_ranks_waiting_in_the_same_collective_are_not_stragglers() -> None:
    every = {r: {"default_pg#0": _last("default_pg#0", 4)} for r in range(4)}
    assert stragglers(every) == {}
    assert "behind" not in describe(every)


def test_point_to_point_numbers_are_not_compared() -> None:
    every = {
        0: {"pp#2:p2p": _last("pp#2:p2p", 9, "gloo:send")},
        1: {"pp#2:p2p": _last("pp#2:p2p", 2, "gloo:recv")},
    }
    assert stragglers(every) == {}


def test_a_group_without_a_collective_yet_reads_none_started() -> None:
    every = {0: {"dp#3": _last("dp#3", 0, "")}, 1: {"dp#3": _last("dp#3", 1)}}
    assert "rank 0: none started   <- behind" in describe(every)


def test_records_round_trip_through_json_ready_dicts() -> None:
    mine = {"default_pg#0": _last("default_pg#0", 5)}
    assert from_dict(to_dict(mine)) == mine
    assert from_dict({"x": {"bogus": 1}}) == {}  # a beat of another version is skipped


def test_the_flight_recorder_is_enabled_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    enable(env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000"}
    for chosen in ({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}):
        env = dict(chosen)
        enable(env)
        assert env == chosen


@pytest.mark.parametrize(("raw", "seconds"), [("", None), ("0", None), ("2.5", 2.5), (" 30 ", 30)])
def test_watchdog_values(raw: str, seconds: float | None) -> None:
    assert parse_watchdog(raw) == seconds
    assert watchdog_seconds({"KOLOSSOS_WATCHDOG": raw}) == seconds


@pytest.mark.parametrize("raw", ["abc", "-3", "inf", "nan"])
def test_bad_watchdog_values_name_the_rule(raw: str) -> None:
    with pytest.raises(ValueError, match=r"KOLOSSOS_WATCHDOG=.* is not a number of seconds >= 0"):
        watchdog_seconds({"KOLOSSOS_WATCHDOG": raw})


def _plan(*hosts: str, master: str | None = None) -> LaunchPlan:
    return LaunchPlan(
        hosts=[HostEntry(host=h) for h in hosts],
        nproc_per_node=2,
        master_addr=master or hosts[0],
        master_port=29500,
        script="train.py",
        master_chosen=master is not None,
    )


def test_a_restart_drops_the_nodes_that_do_not_answer() -> None:
    plan = _plan("node1", "node2", "node3")
    kept = live_hosts(plan, probe=lambda _, host: host != "node2")
    assert [e.host for e in kept.hosts] == ["node1", "node3"]
    assert kept.master_addr == "node1"
    assert live_hosts(plan, probe=lambda *_: True) is plan


def test_the_rendezvous_follows_the_first_node_unless_it_was_chosen() -> None:
    moved = live_hosts(_plan("node1", "node2"), probe=lambda _, host: host != "node1")
    assert moved.master_addr == "node2" and [e.host for e in moved.hosts] == ["node2"]
    chosen = _plan("node1", "node2", master="node1")
    with pytest.raises(LaunchConfigError, match="--master_addr node1 does not answer"):
        live_hosts(chosen, probe=lambda _, host: host != "node1")
    with pytest.raises(LaunchConfigError, match="no node answers over ssh any more"):
        live_hosts(_plan("node1", "node2"), probe=lambda *_: False)


def test_a_local_job_is_never_probed() -> None:
    plan = dataclasses.replace(_plan("localhost"), hosts=[])
    assert live_hosts(plan, probe=lambda *_: pytest.fail("probed")) is plan
