"""``kolossos run`` across two "nodes" reached over real ssh on loopback (127.0.0.1, 127.0.0.2).

The module starts its own sshd (port from the OS, throw-away host and user keys in a temporary
folder, listening on loopback only) and gives ``kolossos run`` the client settings through
``--ssh-config`` (the ssh client reads ``~/.ssh/config`` from the passwd home, not from ``$HOME``).
Skipped only when no ``sshd`` binary is installed (``apt-get install openssh-server``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from kolossos.testing.network import free_port
from kolossos.testing.processes import (
    job_env,
    kolossos_cli,
    survivors,
    wait_for_pids,
    wait_no_survivors,
)

REPO = Path(__file__).resolve().parents[2]
SLEEPER = """\
import os, sys, time
rank = os.environ["RANK"]
tmp = os.path.join(sys.argv[1], f"rank{rank}.tmp")
with open(tmp, "w") as fh:
    fh.write(str(os.getpid()))
os.rename(tmp, os.path.join(sys.argv[1], f"rank{rank}.pid"))
time.sleep(120)
"""


SSHD = shutil.which("sshd") or next(
    (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)), None
)
NODES = ("127.0.0.1", "127.0.0.2")

pytestmark = pytest.mark.skipif(
    SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None,
    reason="no OpenSSH server/client installed (apt-get install openssh-server openssh-client)",
)


@dataclass(frozen=True)
class SshSetup:
    """A running loopback sshd and the ``kolossos run`` options that reach it."""

    port: int
    config: Path
    folder: Path

    def run_args(self) -> list[str]:
        return ["--ssh-port", str(self.port), "--ssh-config", str(self.config)]


def _write_configs(folder: Path, port: int) -> Path:
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True
        )
    shutil.copy(folder / "user_key.pub", folder / "authorized_keys")
    listen = "".join(f"ListenAddress {node}:{port}\n" for node in NODES)
    (folder / "sshd_config").write_text(
        f"{listen}HostKey {folder}/host_key\nPidFile {folder}/sshd.pid\n"
        f"AuthorizedKeysFile {folder}/authorized_keys\nPubkeyAuthentication yes\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nX11Forwarding no\n"
        "AllowTcpForwarding no\nPrintMotd no\nLogLevel ERROR\n"
    )
    client = folder / "ssh_config"
    client.write_text(
        f"Host *\n  IdentityFile {folder}/user_key\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        "  ConnectTimeout 10\n"
    )
    return client


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshSetup]:
    """Start ``sshd -D`` on a free port for the module; stop it afterwards."""
    assert SSHD is not None
    folder = tmp_path_factory.mktemp("sshd")
    port = free_port()
    config = _write_configs(folder, port)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    log = folder / "sshd.log"
    cmd = [SSHD, "-D", "-f", str(folder / "sshd_config"), "-E", str(log)]
    server = subprocess.Popen(cmd, start_new_session=True)
    setup = SshSetup(port=port, config=config, folder=folder)
    try:
        probe = ["ssh", "-F", str(config), "-p", str(port), "-o", "BatchMode=yes"]
        deadline = time.monotonic() + 20
        for node in NODES:
            while subprocess.run([*probe, node, "true"], capture_output=True).returncode != 0:
                assert server.poll() is None, f"sshd exited: {log.read_text(errors='replace')}"
                assert time.monotonic() < deadline, f"sshd unreachable on {node}"
                time.sleep(0.2)
        yield setup
    finally:
        server.terminate()
        server.wait(timeout=10)


def _hostfile(folder: Path) -> Path:
    path = folder / "hostfile"
    path.write_text("# two nodes on one machine\n" + "".join(f"{n} slots=2\n" for n in NODES))
    return path


def test_two_nodes_all_reduce_over_ssh(sshd: SshSetup, tmp_path: Path) -> None:
    argv = [*kolossos_cli(), "run", "--hostfile", str(_hostfile(tmp_path)), *sshd.run_args()]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    result = subprocess.run(
        [*argv, "examples/hello_dist.py"],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=900,  # only detects a hang: tests never gate on speed
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert sorted(line.split(" (")[0] for line in lines) == [f"rank {r}/4" for r in range(4)]
    assert all("all_reduce(rank + 1) = 10, expected 10: OK" in line for line in lines), lines
    # ranks 2 and 3 are local ranks 0 and 1 of the second node
    assert any(line.startswith("rank 3/4 (local rank 1,") for line in lines), lines


@pytest.mark.parametrize("victim", ["remote-rank", "launcher-kill"])
def test_failure_stops_both_nodes(victim: str, sshd: SshSetup, tmp_path: Path) -> None:
    script = tmp_path / f"ssh_sleeper_{victim}.py"
    script.write_text(SLEEPER)
    argv = [*kolossos_cli(), "run", "--hostfile", str(_hostfile(tmp_path)), *sshd.run_args()]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    with open(tmp_path / "log.txt", "wb") as log:
        proc = subprocess.Popen(
            [*argv, str(script), str(tmp_path)],
            cwd=tmp_path,
            env=job_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tree: list[psutil.Process] = []
    try:
        pids = wait_for_pids(tmp_path, 4, proc)
        tree = psutil.Process(proc.pid).children(recursive=True)  # the ssh clients
        remote = survivors(script.name, [])
        assert set(pids.values()) <= {p.pid for p in remote}
        start = time.monotonic()
        os.kill(pids[3] if victim == "remote-rank" else proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
        assert time.monotonic() - start < 30
        log_text = (tmp_path / "log.txt").read_text(errors="replace")
        if victim == "remote-rank":
            assert code not in (0, 255), log_text
            assert "node 1 (127.0.0.2) exited with code" in log_text, log_text
        else:
            assert code == -signal.SIGKILL
        # remote processes hang off sshd, not the launcher: they must go when ssh closes
        wait_no_survivors(script.name, tree + remote, within_s=15)
    finally:
        if proc.poll() is None:
            proc.kill()
        wait_no_survivors(script.name, tree, within_s=0)


def test_unreachable_node_fails_fast(sshd: SshSetup, tmp_path: Path) -> None:
    """ssh's own failure (nothing listens on the port) ends the job with 255 and a hint."""
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('must not run')\n")
    argv = [*kolossos_cli(), "run", "--hostfile", str(_hostfile(tmp_path))]
    argv += ["--ssh-config", str(sshd.config), "--ssh-port", str(free_port())]
    argv += ["--master_addr", "127.0.0.1", str(script)]
    result = subprocess.run(argv, cwd=tmp_path, env=job_env(), capture_output=True, text=True)
    assert result.returncode == 255, result.stderr
    assert "check the ssh setup" in result.stderr


RESTARTER = """\
import os, sys
import torch, torch.distributed as dist
import kolossos

kolossos.launch_from_torch(config={}, verbose=False)
folder, attempt, rank = sys.argv[1], int(os.environ["KOLOSSOS_RESTART_COUNT"]), dist.get_rank()
with open(os.path.join(folder, f"attempt{attempt}.rank{rank}"), "w") as fh:
    fh.write(str(dist.get_world_size()))
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and rank == 2:  # node 1 "dies": from now on its ssh port is closed
    with open(sys.argv[2], "w") as fh:
        fh.write(sys.argv[3])
if attempt == 0 and rank >= 2:
    raise SystemExit(1)
"""


def test_a_restart_continues_without_a_node_that_is_gone(sshd: SshSetup, tmp_path: Path) -> None:
    base = sshd.config.read_text()
    config = tmp_path / "ssh_config"
    alive = f"Host 127.0.0.2\n  Port {sshd.port}\nHost *\n  Port {sshd.port}\n{base}"
    gone = f"Host 127.0.0.2\n  Port {free_port()}\nHost *\n  Port {sshd.port}\n{base}"
    config.write_text(alive)
    script = tmp_path / "restarter.py"
    script.write_text(RESTARTER)
    argv = [*kolossos_cli(), "run", "--hostfile", str(_hostfile(tmp_path))]
    argv += ["--ssh-config", str(config), "--max_restarts", "1"]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    result = subprocess.run(
        [*argv, str(script), str(tmp_path), str(config), gone],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=900,  # only detects a hang
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node(s) 127.0.0.2 do not answer over ssh; continuing on 1 node(s) (2 processes)" in (
        result.stderr
    ), result.stderr
    worlds = {p.name: p.read_text() for p in tmp_path.glob("attempt*")}
    assert worlds == {
        **{f"attempt0.rank{r}": "4" for r in range(4)},
        **{f"attempt1.rank{r}": "2" for r in range(2)},
    }
