"""``kolossos run`` argument checking, command building and ``--dry-run`` (nothing is started)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kolossos.cli import run
from kolossos.cli.launcher import command as cmd
from kolossos.cli.launcher import multinode
from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.plan import build_plan


@pytest.fixture(autouse=True)
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cwd holding ``train.py`` and a 3-host ``hosts`` file; starting a process fails the test."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts").write_text("node1 slots=2\nnode2 slots=2\nnode3 slots=2\n")

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a process was started: {args!r}")

    monkeypatch.setattr(multinode, "run_nodes", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    return tmp_path


def _fail(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kolossos run: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--hostfile", "missing.txt", "train.py"], ["missing.txt", "cannot be read"]),
        (["--hostfile", "empty", "train.py"], ["empty", "no hosts"]),
        (["--hostfile", "bad", "train.py"], ["bad:2", "slots=x"]),
        (["--hostfile", "hosts", "--include", "node9", "train.py"], ["'node9'", "--include"]),
        (["--hostfile", "hosts", "--exclude", "nodeX", "train.py"], ["'nodeX'", "--exclude"]),
        (["--hostfile", "hosts", "--include", "node1", "--exclude", "node2", "train.py"],
         ["--include and --exclude", "mutually exclusive"]),
        (["--include", "node1", "train.py"], ["--include 'node1' needs --hostfile"]),
        (["--exclude", "node1", "train.py"], ["--exclude 'node1' needs --hostfile"]),
        (["--host", "node1", "--hostfile", "hosts", "train.py"], ["'node1'", "'hosts'", "one of"]),
        (["--host", "node1,node2", "--master_addr", "localhost", "train.py"],
         ["'localhost'", "loopback", "node1, node2"]),
        (["--host", "node1,node2", "--master_addr", "127.0.0.9", "train.py"], ["'127.0.0.9'"]),
        (["--host", "localhost,node2", "train.py"], ["first host 'localhost'", "--master_addr"]),
        (["--nproc_per_node", "0", "train.py"], ["--nproc_per_node 0", "at least 1"]),
        (["--nproc_per_node", "-3", "train.py"], ["--nproc_per_node -3"]),
        (["--nproc_per_node", "four", "train.py"], ["'four'"]),
        (["--hostfile", "hosts", "--num_nodes", "4", "train.py"], ["--num_nodes 4", "3 host"]),
        (["--hostfile", "hosts", "--num_nodes", "0", "train.py"], ["--num_nodes 0"]),
        (["--num_nodes", "2", "train.py"], ["--num_nodes 2 needs --hostfile"]),
        (["--host", "node1,node2", "--num_nodes", "1", "train.py"], ["--num_nodes 1 needs"]),
        (["missing_script.py"], ["'missing_script.py'", "does not exist"]),
        ([], ["no script given", "kolossos run [options] script.py"]),
        (["--nproc_per_node", "2"], ["no script given"]),
        (["--extra_launch_args", "a=1,,b=2", "train.py"], ["'a=1,,b=2'", "item ''"]),
        (["--extra_launch_args", "=1", "train.py"], ["item '=1'"]),
        (["--extra_launch_args=--log_dir=x", "train.py"], ["'--log_dir=x'", "no leading"]),
        (["--extra_launch_args", "a b=1", "train.py"], ["'a b=1'"]),
        (["--extra_launch_args", "nnodes=3", "train.py"], ["'nnodes' is set by kolossos run"]),
        (["--extra_launch_args", "master-port=1", "train.py"], ["'master-port'"]),
        (["--host", "a;rm -rf /", "train.py"], ["'a;rm -rf /'", "not a valid host name"]),
        (["--host=-oProxyCommand=sh", "train.py"], ["'-oProxyCommand=sh'"]),
        (["--hostfile", "hosts", "--include", "$(reboot)", "train.py"], ["'$(reboot)'"]),
        (["--master_addr", "a b", "train.py"], ["--master_addr 'a b'"]),
        (["--master_port", "0", "train.py"], ["--master_port 0", "1..65535"]),
        (["--master_port", "70000", "train.py"], ["--master_port 70000"]),
        (["--host", "node1,node2", "--ssh-port", "0", "train.py"], ["--ssh-port 0"]),
        (["--host", "n1,n2", "--ssh-config", "nope.cfg", "train.py"], ["'nope.cfg'", "not a file"]),
        (["--host", "n1,n2", "--ssh-option=-v", "train.py"], ["--ssh-option '-v'"]),
        (["--hostfile", "hosts", "--nproc_per_node", "4", "train.py"],
         ["--nproc_per_node 4 disagrees", "node1 slots=2"]),
        (["--hostfile", "mixed", "train.py"], ["different slot counts", "b slots=3"]),
        (["--bogus", "train.py"], ["--bogus"]),
        (["--host", "-x", "train.py"], ["--host", "expected one argument", "--option=VALUE"]),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_the_value(
    argv: list[str], needles: list[str], workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (workdir / "empty").write_text("# nothing here\n")
    (workdir / "bad").write_text("node1\nnode2 slots=x\n")
    (workdir / "mixed").write_text("a slots=2\nb slots=3\n")
    _fail(argv, capsys, *needles)


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--nproc_per_node" in out and "--hostfile" in out and "--extra_launch_args" in out


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[tuple[str, list[str]]]:
    assert run.main(["--dry-run", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) % 2 == 0
    return [(lines[i], shlex.split(lines[i + 1])) for i in range(0, len(lines), 2)]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dry_run_single_node(capsys: pytest.CaptureFixture[str]) -> None:
    weird = ["--lr", "0.1", "two words", 'it\'s "quoted"', "$(reboot); rm -rf /", ""]
    argv = ["--nproc_per_node", "4", "--master_port", "29511"]
    argv += ["--extra_launch_args", "monitor_interval=1,log-dir=/tmp/l s", "train.py", *weird]
    [(header, words)] = _dry_run(argv, capsys)
    assert "local" in header
    torchrun = words[words.index("--") + 1 :]
    assert torchrun[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert _flag(torchrun, "--nproc_per_node") == "4"
    assert _flag(torchrun, "--nnodes") == "1"
    assert _flag(torchrun, "--node_rank") == "0"
    assert _flag(torchrun, "--master_addr") == "127.0.0.1"
    assert _flag(torchrun, "--master_port") == "29511"
    assert _flag(torchrun, "--max_restarts") == "0"
    assert _flag(torchrun, "--monitor_interval") == "1"
    assert _flag(torchrun, "--log-dir") == "/tmp/l s"
    assert torchrun[torchrun.index("train.py") + 1 :] == weird


def test_dry_run_local_host_runs_without_ssh(capsys: pytest.CaptureFixture[str]) -> None:
    [(_, words)] = _dry_run(["--host", "localhost", "train.py"], capsys)
    assert "ssh" not in words and _flag(words, "--nnodes") == "1"
    assert _flag(words, "--nproc_per_node") == "1"  # default without slots


def _remote_words(words: list[str]) -> list[str]:
    """Split the remote shell command the way the remote shell will."""
    host_at = words.index("--") + 1
    assert len(words) == host_at + 2  # ssh ... -- HOST COMMAND
    return shlex.split(words[host_at + 1])


def test_dry_run_hostfile_multi_node(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weird = ["a b", "c'd", "$HOME", "`id`", ";", "&&", "x|y"]
    argv = ["--hostfile", "hosts", "--exclude", "node2", "--ssh-port", "2222"]
    argv += ["--ssh-option", "ConnectTimeout=7", "train.py", *weird]
    nodes = _dry_run(argv, capsys)
    assert [h.split(": ")[1] for h, _ in nodes] == ["node1 (over ssh)", "node3 (over ssh)"]
    for rank, (_, words) in enumerate(nodes):
        assert words[0] == "ssh" and "BatchMode=yes" in words and "-T" in words
        assert _flag(words, "-p") == "2222" and "ConnectTimeout=7" in words
        assert words[-2] == ("node1", "node3")[rank]
        remote = _remote_words(words)
        assert remote[:5] == ["cd", str(workdir), "&&", "exec", "env"]
        torchrun = remote[remote.index("--") + 1 :]
        assert _flag(torchrun, "--nnodes") == "2"
        assert _flag(torchrun, "--node_rank") == str(rank)
        assert _flag(torchrun, "--master_addr") == "node1"  # default: the first host
        assert _flag(torchrun, "--nproc_per_node") == "2"  # from slots=2
        assert torchrun[torchrun.index("train.py") + 1 :] == weird


def test_num_nodes_and_include(capsys: pytest.CaptureFixture[str]) -> None:
    nodes = _dry_run(["--hostfile", "hosts", "--num_nodes", "2", "train.py"], capsys)
    assert [words[-2] for _, words in nodes] == ["node1", "node2"]
    nodes = _dry_run(["--hostfile", "hosts", "--include", "node3,node2", "train.py"], capsys)
    assert [words[-2] for _, words in nodes] == ["node2", "node3"]
    [(_, words)] = _dry_run(["--hostfile", "hosts", "--include", "node2", "train.py"], capsys)
    remote = _remote_words(words)  # one remote node: still ssh, talks to itself
    assert _flag(remote, "--nnodes") == "1" and _flag(remote, "--master_addr") == "127.0.0.1"


def test_loopback_master_allowed_when_all_nodes_are_loopback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--host", "127.0.0.1,127.0.0.2", "--master_addr", "127.0.0.1", "train.py"]
    nodes = _dry_run(argv, capsys)
    assert len(nodes) == 2
    assert all(_flag(_remote_words(w), "--master_addr") == "127.0.0.1" for _, w in nodes)


def test_env_forwarding() -> None:
    environ = {
        "PATH": "/bin",
        "PYTHONPATH": "/src dir",
        "OMP_NUM_THREADS": "1",
        "KOLOSSOS_X": "it's",
        "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCH_LOGS": "+dynamo",
        "HF_HOME": "/hf",
        "HF_TOKEN": "secret",
        "KOLOSSOS_API_KEY": "secret",
        "HOME": "/root",
        "SSH_AUTH_SOCK": "/x",
        "MY_VAR": "kept",
        "MY_TOKEN": "explicit",
        "KOLOSSOS_RUN_EXPORT": "MY_VAR, MY_TOKEN",
        "BAD-NAME": "x",
    }
    env = cmd.forwarded_env(environ)
    assert set(env) == {
        "PATH", "PYTHONPATH", "OMP_NUM_THREADS", "KOLOSSOS_X", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME",
        "TORCH_LOGS", "HF_HOME", "MY_VAR", "MY_TOKEN", "KOLOSSOS_RUN_EXPORT",
    }  # fmt: skip
    line = cmd.remote_shell_command(cwd="/w d", env=env, argv=["py", "s.py"])
    words = shlex.split(line)
    assert words[:5] == ["cd", "/w d", "&&", "exec", "env"]
    assert "KOLOSSOS_X=it's" in words and "PYTHONPATH=/src dir" in words
    assert words[-2:] == ["py", "s.py"]


def test_extra_launch_args_parsing() -> None:
    assert cmd.parse_extra_launch_args(None) == []
    assert cmd.parse_extra_launch_args("a=1,b-c=x=y,run_path") == [
        "--a", "1", "--b-c", "x=y", "--run_path",
    ]  # fmt: skip
    with pytest.raises(LaunchConfigError, match="'nproc-per-node' is set by kolossos run"):
        cmd.parse_extra_launch_args("nproc-per-node=2")


def test_ssh_argv_shape() -> None:
    argv = cmd.ssh_argv(host="h", command="true", ssh_port=22, ssh_config="c", ssh_options=["A=b"])
    assert argv == [
        "ssh", "-T", "-o", "BatchMode=yes", "-F", "c", "-o", "A=b", "-p", "22", "--", "h", "true",
    ]  # fmt: skip


def test_build_plan_is_a_pure_function(workdir: Path) -> None:
    plan = build_plan(script="train.py", host="localhost")
    assert plan.is_local and plan.nproc_per_node == 1 and plan.master_addr == "127.0.0.1"
    plan = build_plan(script="train.py", hostfile="hosts", include="node1")
    assert not plan.is_local and plan.nproc_per_node == 2
