"""Validate the ``kolossos run`` values into a :class:`LaunchPlan`; derive the per-node commands."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kolossos.cli.launcher import command as cmd
from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.hostfile import (
    HostEntry,
    is_local_host,
    is_loopback,
    parse_name_list,
    read_hostfile,
    select_hosts,
    validate_hostname,
)
from kolossos.cli.launcher.limits import check_nproc, check_port
from kolossos.launch_env import parse_watchdog

#: Seconds a node's guard waits between SIGTERM and SIGKILL when stopping its processes.
GUARD_GRACE_S = 5.0
_SSH_OPTION_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*[= ]\S[^\n]*")


@dataclass(frozen=True, kw_only=True)
class NodeCommand:
    """The process ``kolossos run`` starts for one node."""

    host: str
    """The node's host name (``127.0.0.1`` for a local single-node run without hosts)."""
    node_rank: int
    """The node's ``--node_rank``."""
    argv: list[str]
    """The command: the guard around torchrun (local) or ssh (remote)."""
    remote: bool
    """Whether ``argv`` goes through ssh."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """A validated ``kolossos run`` invocation."""

    hosts: list[HostEntry]
    """The selected nodes in node-rank order; empty for a plain local run."""
    nproc_per_node: int
    """Processes per node (``--nproc_per_node``, else the hostfile's slots, else 1)."""
    master_addr: str
    """Address of the rendezvous store (node 0)."""
    master_port: int
    """Port of the rendezvous store."""
    script: str
    """The user's script, as given."""
    script_args: list[str] = field(default_factory=list)
    """Arguments passed to the script untouched."""
    extra_flags: list[str] = field(default_factory=list)
    """torchrun flags from ``--extra_launch_args``."""
    ssh_port: int | None = None
    """``ssh -p``; ``None`` leaves the port to ``~/.ssh/config``."""
    ssh_config: str | None = None
    """``ssh -F``; ``None`` uses ``~/.ssh/config``."""
    ssh_options: list[str] = field(default_factory=list)
    """Extra ``ssh -o`` options."""
    master_chosen: bool = False
    """Whether ``--master_addr`` was given (else it follows the first node on restarts)."""
    max_restarts: int = 0
    """Relaunches of the whole job after a failure (``--max_restarts``)."""
    watchdog_s: float | None = None
    """The progress watchdog's time in seconds (``--watchdog``); ``None``: the environment's
    ``KOLOSSOS_WATCHDOG``, if any."""
    python: str = field(default_factory=lambda: sys.executable)
    """The Python that runs torchrun and the script, on every node."""
    cwd: str = field(default_factory=os.getcwd)
    """The directory every node changes into."""

    @property
    def is_local(self) -> bool:
        """Whether the job runs on this machine only, without ssh."""
        return not self.hosts or (len(self.hosts) == 1 and is_local_host(self.hosts[0].host))

    def node_commands(self, environ: Mapping[str, str] | None = None) -> list[NodeCommand]:
        """Build every node's command; ``environ`` (default ``os.environ``) feeds the export."""
        nnodes = max(1, len(self.hosts))
        names = [entry.host for entry in self.hosts] or ["127.0.0.1"]
        env = cmd.forwarded_env(os.environ if environ is None else environ)
        nodes = []
        for rank, host in enumerate(names):
            torchrun = cmd.torchrun_argv(
                python=self.python,
                nproc_per_node=self.nproc_per_node,
                nnodes=nnodes,
                node_rank=rank,
                master_addr=self.master_addr,
                master_port=self.master_port,
                extra_flags=self.extra_flags,
                script=self.script,
                script_args=self.script_args,
            )
            guarded = cmd.guard_argv(python=self.python, grace=GUARD_GRACE_S, command=torchrun)
            if self.is_local:
                nodes.append(NodeCommand(host=host, node_rank=rank, argv=guarded, remote=False))
                continue
            remote = cmd.remote_shell_command(cwd=self.cwd, env=env, argv=guarded)
            argv = cmd.ssh_argv(
                host=host,
                command=remote,
                ssh_port=self.ssh_port,
                ssh_config=self.ssh_config,
                ssh_options=self.ssh_options,
            )
            nodes.append(NodeCommand(host=host, node_rank=rank, argv=argv, remote=True))
        return nodes


def _resolve_hosts(
    *,
    host: str | None,
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
    num_nodes: int,
) -> list[HostEntry]:
    if host is not None and hostfile is not None:
        raise LaunchConfigError(
            f"--host {host!r} and --hostfile {hostfile!r} were both given; use one of them."
        )
    if hostfile is None:
        for flag, value in (("--include", include), ("--exclude", exclude)):
            if value is not None:
                raise LaunchConfigError(
                    f"{flag} {value!r} needs --hostfile: it selects hosts of a hostfile. Pass "
                    "--hostfile FILE, or list the wanted hosts with --host."
                )
        if num_nodes != -1:
            raise LaunchConfigError(
                f"--num_nodes {num_nodes} needs --hostfile: it takes the first hosts of a "
                "hostfile. Pass --hostfile FILE, or list exactly the wanted hosts with --host."
            )
    if host is not None:
        return [HostEntry(host=name) for name in parse_name_list(host, what="--host")]
    if hostfile is None:
        return []
    entries = read_hostfile(hostfile)
    return select_hosts(
        entries,
        include=None if include is None else parse_name_list(include, what="--include"),
        exclude=None if exclude is None else parse_name_list(exclude, what="--exclude"),
        num_nodes=num_nodes,
    )


def _resolve_nproc(nproc_per_node: int | None, hosts: Sequence[HostEntry]) -> int:
    if nproc_per_node is not None and nproc_per_node < 1:
        raise LaunchConfigError(
            f"--nproc_per_node {nproc_per_node} is invalid: it must be at least 1 (processes to "
            "start on each node); pass e.g. --nproc_per_node 2."
        )
    slots = {entry.host: entry.slots for entry in hosts if entry.slots is not None}
    if nproc_per_node is not None:
        wrong = {h: s for h, s in slots.items() if s != nproc_per_node}
        if wrong:
            listed = ", ".join(f"{h} slots={s}" for h, s in wrong.items())
            raise LaunchConfigError(
                f"--nproc_per_node {nproc_per_node} disagrees with the hostfile ({listed}); make "
                "them equal or drop one of them."
            )
        return nproc_per_node
    if len(set(slots.values())) > 1:
        listed = ", ".join(f"{h} slots={s}" for h, s in slots.items())
        raise LaunchConfigError(
            f"the hostfile gives different slot counts ({listed}); every node runs the same "
            "number of processes. Make the slots equal or pass --nproc_per_node."
        )
    return next(iter(slots.values()), 1)


def _resolve_master(master_addr: str | None, hosts: Sequence[HostEntry]) -> str:
    if master_addr is not None:
        validate_hostname(master_addr, what="--master_addr")
    master = master_addr or (hosts[0].host if len(hosts) > 1 else "127.0.0.1")
    remote = [entry.host for entry in hosts if not is_loopback(entry.host)]
    if len(hosts) > 1 and is_loopback(master) and remote:
        given = f"--master_addr {master!r}" if master_addr else f"the first host {master!r}"
        raise LaunchConfigError(
            f"{given} is a loopback address, but the job spans {len(hosts)} nodes "
            f"({', '.join(remote)} cannot reach it). Pass --master_addr with the host name or IP "
            "address of the first node as the other nodes see it."
        )
    return master


def build_plan(
    *,
    script: str,
    script_args: Sequence[str] = (),
    nproc_per_node: int | None = None,
    host: str | None = None,
    hostfile: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int = -1,
    master_addr: str | None = None,
    master_port: int = 29500,
    ssh_port: int | None = None,
    ssh_config: str | None = None,
    ssh_options: Sequence[str] = (),
    extra_launch_args: str | None = None,
    max_restarts: int = 0,
    watchdog: str | None = None,
) -> LaunchPlan:
    """Check every ``kolossos run`` value and return the plan; nothing is started here.

    Raises:
        LaunchConfigError: naming the bad value, the rule and the fix (see ``docs/launch.md``).
    """
    hosts = _resolve_hosts(
        host=host, hostfile=hostfile, include=include, exclude=exclude, num_nodes=num_nodes
    )
    nproc = _resolve_nproc(nproc_per_node, hosts)
    here = not hosts or any(is_local_host(entry.host) for entry in hosts)  # a node runs here
    given = (
        f"--nproc_per_node {nproc}"
        if nproc_per_node is not None
        else f"the hostfile's slots={nproc}"
    )
    check_nproc(nproc, local=here, what=given)
    master = _resolve_master(master_addr, hosts)
    check_port(master_port, "--master_port")
    if ssh_port is not None:
        check_port(ssh_port, "--ssh-port")
    if ssh_config is not None and not os.path.isfile(ssh_config):
        raise LaunchConfigError(
            f"--ssh-config {ssh_config!r} is not a file; pass the path of an ssh_config file."
        )
    for option in ssh_options:
        if not _SSH_OPTION_RE.fullmatch(option):
            raise LaunchConfigError(
                f"--ssh-option {option!r} is not 'Keyword=value'; write e.g. "
                "--ssh-option ConnectTimeout=10."
            )
    extra = cmd.parse_extra_launch_args(extra_launch_args)
    if os.path.isdir(script):
        raise LaunchConfigError(
            f"script {script!r} is a folder, not a Python file; pass the path of the script to "
            "run (e.g. its train.py)."
        )
    if not os.path.isfile(script):
        raise LaunchConfigError(
            f"script {script!r} does not exist (looked in {os.getcwd()}); pass the path of the "
            "Python script to run, relative to the current directory or absolute."
        )
    if max_restarts < 0:
        raise LaunchConfigError(
            f"--max_restarts {max_restarts} is invalid: it counts relaunches after a failure; "
            "pass 0 (the default: no restart) or more."
        )
    try:
        watchdog_s = None if watchdog is None else parse_watchdog(watchdog, "--watchdog")
    except ValueError as exc:
        raise LaunchConfigError(str(exc)) from None
    return LaunchPlan(
        hosts=hosts,
        nproc_per_node=nproc,
        master_addr=master,
        master_port=master_port,
        script=script,
        script_args=list(script_args),
        extra_flags=extra,
        ssh_port=ssh_port,
        ssh_config=ssh_config,
        ssh_options=list(ssh_options),
        master_chosen=master_addr is not None,
        max_restarts=max_restarts,
        watchdog_s=watchdog_s,
    )
