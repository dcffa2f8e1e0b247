"""Run a launch plan to the end, relaunching the whole job after a failure (``--max_restarts``).

A job that fails (a node exits non-zero, a rank is killed, the watchdog ends a stuck rank) is
stopped everywhere and started again, at most ``max_restarts`` times. Before each restart every
remote node is probed over ssh; a node that does not answer is dropped, so the job continues on
fewer nodes (and fewer ranks: the script must resume from a checkpoint that reshards, as kolossos
checkpoints do). A stop by signal (Ctrl-C) is never restarted. Each attempt's processes see
``KOLOSSOS_RESTART_COUNT`` (0 for the first launch), so a script can tell a restart from a fresh
start.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable

from kolossos.cli.launcher import command as cmd
from kolossos.cli.launcher import multinode
from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.plan import LaunchPlan

__all__ = ["PROBE_TIMEOUT_S", "RESTART_ENV", "live_hosts", "run_with_restarts"]

#: the environment variable holding the attempt number (0: first launch)
RESTART_ENV = "KOLOSSOS_RESTART_COUNT"
#: seconds a node has to answer the ssh probe before a restart
PROBE_TIMEOUT_S = 10
_SIGNAL_EXITS = (128 + 1, 128 + 2, 128 + 15)  # our own SIGHUP, SIGINT, SIGTERM


def _say(message: str) -> None:
    print(f"kolossos run: {message}", file=sys.stderr, flush=True)


def _answers(plan: LaunchPlan, host: str) -> bool:
    """Whether ``host`` runs a command over ssh within :data:`PROBE_TIMEOUT_S`."""
    argv = cmd.ssh_argv(
        host=host,
        command="true",
        ssh_port=plan.ssh_port,
        ssh_config=plan.ssh_config,
        ssh_options=[*plan.ssh_options, f"ConnectTimeout={PROBE_TIMEOUT_S}"],
    )
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S + 5
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def live_hosts(plan: LaunchPlan, probe: Callable[[LaunchPlan, str], bool] = _answers) -> LaunchPlan:
    """``plan`` without the remote nodes that do not answer ``probe`` (local runs unchanged).

    The rendezvous moves to the first remaining node when the old one is gone and was chosen by
    default.

    Raises:
        LaunchConfigError: no node answers, or the ``--master_addr`` given is among the gone.
    """
    if plan.is_local:
        return plan
    alive = [entry for entry in plan.hosts if probe(plan, entry.host)]
    gone = [entry.host for entry in plan.hosts if entry not in alive]
    if not gone:
        return plan
    if not alive:
        raise LaunchConfigError(
            f"no node answers over ssh any more ({', '.join(gone)}); nothing to restart on. "
            "Check the nodes, then run the command again."
        )
    master = plan.master_addr
    if master in gone:
        if master != plan.hosts[0].host or plan.master_chosen:
            raise LaunchConfigError(
                f"--master_addr {master} does not answer any more; restart the job with the "
                "address of a remaining node."
            )
        master = alive[0].host
    _say(
        f"node(s) {', '.join(gone)} do not answer over ssh; continuing on {len(alive)} node(s) "
        f"({len(alive) * plan.nproc_per_node} processes), rendezvous at {master}"
    )
    return dataclasses.replace(plan, hosts=alive, master_addr=master)


def run_with_restarts(
    plan: LaunchPlan,
    max_restarts: int = 0,
    *,
    before: Callable[[int, LaunchPlan], LaunchPlan] | None = None,
    restartable: Callable[[int], bool] | None = None,
    prog: str = "kolossos run",
) -> int:
    """Run ``plan``; after a failure, run it again (at most ``max_restarts`` times).

    Args:
        plan: the checked plan.
        max_restarts: relaunches allowed after failures.
        before: called with the attempt number and the plan before each launch; returns the
            plan to launch (``kolossos train`` uses it to resume from the latest checkpoint).
        restartable: whether a failed attempt's exit code may be retried (default: any code
            but a stop by signal).
        prog: the command named in the restart messages.

    Returns:
        The last attempt's exit code.
    """
    attempt = 0
    while True:
        if before is not None:
            plan = before(attempt, plan)
        os.environ[RESTART_ENV] = str(attempt)  # read by every process of this attempt
        code = multinode.run_nodes(plan.node_commands())
        if code == 0 or code in _SIGNAL_EXITS or attempt >= max_restarts:
            return code
        if restartable is not None and not restartable(code):
            return code
        attempt += 1
        try:
            plan = live_hosts(plan)
        except LaunchConfigError as exc:
            _say(f"cannot restart: {exc}")
            return code
        print(
            f"{prog}: the job failed with exit code {code}; restart {attempt} of {max_restarts}",
            file=sys.stderr,
            flush=True,
        )
