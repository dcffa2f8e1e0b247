"""Hostfile parsing, host-name validation and node selection for ``kolossos run``."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.hostfile import (
    HostEntry,
    is_local_host,
    is_loopback,
    parse_hostfile_text,
    parse_name_list,
    read_hostfile,
    select_hosts,
    validate_hostname,
)

HOSTFILE = """\
# cluster A
node1 slots=4

node2    slots=4   # trailing comment
  10.0.0.7
gpu-3.cluster.local
"""


def _hosts(entries: list[HostEntry]) -> list[str]:
    return [entry.host for entry in entries]


def test_parse_comments_blank_lines_and_slots() -> None:
    entries = parse_hostfile_text(HOSTFILE)
    assert entries == [
        HostEntry(host="node1", slots=4),
        HostEntry(host="node2", slots=4),
        HostEntry(host="10.0.0.7"),
        HostEntry(host="gpu-3.cluster.local"),
    ]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("node1 slots=abc", "slots=abc"),
        ("node1 slots=0", "slots=0"),
        ("node1 slots=-2", "slots=-2"),
        ("node1 slots", "'slots'"),
        ("node1 cores=4", "cores=4"),
        ("node1:4", "node1:4"),
        ("-oProxyCommand=touch_x", "-oProxyCommand=touch_x"),
        ("a;rm -rf /", "a;rm"),
        ("$(reboot)", "$(reboot)"),
        ("user@node1", "user@node1"),
        ("node1 slots=2 slots=3", "slots=2 slots=3"),
    ],
)
def test_malformed_line_names_value_and_line(line: str, needle: str) -> None:
    with pytest.raises(LaunchConfigError) as info:
        parse_hostfile_text(f"good-host\n{line}\n", source="hf")
    assert needle in str(info.value)
    assert "hf:2" in str(info.value)


def test_duplicate_host_is_rejected() -> None:
    with pytest.raises(
        LaunchConfigError, match=r"'node1' is listed twice \(first on line 1\).*sort -u"
    ):
        parse_hostfile_text("node1\nnode2\nnode1 slots=2\n")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   # another\n"])
def test_empty_hostfile_is_rejected(text: str) -> None:
    with pytest.raises(LaunchConfigError, match="lists no hosts"):
        parse_hostfile_text(text, source="empty-file")


def test_read_hostfile_missing_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(LaunchConfigError, match="cannot be read") as info:
        read_hostfile(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(LaunchConfigError, match="cannot be read"):
        read_hostfile(tmp_path)


def test_read_hostfile_binary_garbage(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_bytes(b"\xff\xfe\x00node")
    with pytest.raises(LaunchConfigError, match="cannot be read"):
        read_hostfile(path)


def test_read_hostfile_ok(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text(HOSTFILE)
    assert _hosts(read_hostfile(path)) == ["node1", "node2", "10.0.0.7", "gpu-3.cluster.local"]


@pytest.mark.parametrize(
    "name",
    [
        "node1",
        "node-1",
        "node_1",
        "gpu1.cluster.local",
        "fqdn.",
        "10.0.0.1",
        "::1",
        "fe80::1",
        "fe80::1%eth0",
    ],
)
def test_valid_hostnames(name: str) -> None:
    assert validate_hostname(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "-x", "-oProxyCommand=x", "a;b", "a b", "$(x)", "`x`", "a|b", "a&b", "user@h", "h:22",
     "a..b", "-", "x" * 254, "a\nb", "node1\n", "nödé",
     "fe80::1%$(reboot)", "fe80::1%a b", " 10.0.0.1"],
)  # fmt: skip
def test_invalid_hostnames(name: str) -> None:
    with pytest.raises(LaunchConfigError, match="not a valid host name") as info:
        validate_hostname(name, what="--host")
    assert repr(name) in str(info.value)


def test_loopback_and_local() -> None:
    for name in ("localhost", "LOCALHOST", "127.0.0.1", "127.0.0.2", "127.1.2.3", "::1"):
        assert is_loopback(name), name
        assert is_local_host(name), name
    for name in ("node1", "10.0.0.1", "192.168.1.1", "localhost2"):
        assert not is_loopback(name), name
    assert is_local_host(socket.gethostname())
    assert not is_local_host("surely-not-this-machine-" + socket.gethostname())


def test_parse_name_list() -> None:
    assert parse_name_list("a,b,10.0.0.1", what="--host") == ["a", "b", "10.0.0.1"]
    with pytest.raises(LaunchConfigError, match="empty host name"):
        parse_name_list("a,,b", what="--host")
    with pytest.raises(LaunchConfigError, match="empty host name"):
        parse_name_list("", what="--include")
    with pytest.raises(LaunchConfigError, match="repeats a"):
        parse_name_list("a,b,a", what="--host")
    with pytest.raises(LaunchConfigError, match="'a;reboot'"):
        parse_name_list("a;reboot", what="--host")


ENTRIES = [HostEntry(host=h) for h in ("h1", "h2", "h3", "h4")]


def test_select_all_include_exclude_num_nodes() -> None:
    assert _hosts(select_hosts(ENTRIES)) == ["h1", "h2", "h3", "h4"]
    # include keeps the hostfile order, not the order of the option
    assert _hosts(select_hosts(ENTRIES, include=["h3", "h1"])) == ["h1", "h3"]
    assert _hosts(select_hosts(ENTRIES, exclude=["h2"])) == ["h1", "h3", "h4"]
    assert _hosts(select_hosts(ENTRIES, num_nodes=2)) == ["h1", "h2"]
    assert _hosts(select_hosts(ENTRIES, exclude=["h1"], num_nodes=2)) == ["h2", "h3"]


def test_select_errors() -> None:
    with pytest.raises(LaunchConfigError, match="mutually exclusive"):
        select_hosts(ENTRIES, include=["h1"], exclude=["h2"])
    with pytest.raises(LaunchConfigError, match=r"--include names 'h9'"):
        select_hosts(ENTRIES, include=["h1", "h9"])
    with pytest.raises(LaunchConfigError, match=r"--exclude names 'zz'"):
        select_hosts(ENTRIES, exclude=["zz"])
    with pytest.raises(LaunchConfigError, match="removes every host"):
        select_hosts(ENTRIES, exclude=["h1", "h2", "h3", "h4"])
    with pytest.raises(LaunchConfigError, match="--num_nodes 5 is larger than the 4"):
        select_hosts(ENTRIES, num_nodes=5)
    with pytest.raises(LaunchConfigError, match="--num_nodes 3 is larger than the 2"):
        select_hosts(ENTRIES, include=["h1", "h2"], num_nodes=3)
    for bad in (0, -2):
        with pytest.raises(LaunchConfigError, match=f"--num_nodes {bad} is invalid"):
            select_hosts(ENTRIES, num_nodes=bad)
