"""What a launch may ask of a node: a TCP port that can be listened on, and a process count the
node can hold. ``kolossos run`` and ``kolossos train`` check both before they start anything.

The process-count rule: at most :data:`PROCS_PER_CPU` processes per CPU core this process may run
on (``os.sched_getaffinity``) for a job on this machine, and at most :data:`REMOTE_MAX_NPROC` per
remote node (whose cores cannot be seen from here). More is a typo, not a plan: every process
loads torch and its own copy of the model.
"""

from __future__ import annotations

import os
import socket

from kolossos.cli.launcher.errors import LaunchConfigError

__all__ = [
    "PROCS_PER_CPU",
    "REMOTE_MAX_NPROC",
    "check_nproc",
    "check_port",
    "check_port_free",
    "max_local_nproc",
    "usable_cpus",
]

#: processes per usable CPU core a job on this machine may start
PROCS_PER_CPU = 8
#: processes a remote node may be asked to start
REMOTE_MAX_NPROC = 1024


def check_port(value: int, flag: str) -> int:
    """Return ``value`` if it is a TCP port number (1..65535).

    Raises:
        LaunchConfigError: naming ``flag`` and the allowed range.
    """
    if not 1 <= value <= 65535:
        raise LaunchConfigError(f"{flag} {value} is not a TCP port; pass a number in 1..65535.")
    return value


def check_port_free(port: int, flag: str) -> None:
    """Raise unless this machine can listen on ``port`` (the rendezvous store of node 0 must).

    The probe binds like a server that sets ``SO_REUSEADDR`` (as torch's store does), so only a
    port another process listens on, or one this user may not open, is refused.

    Raises:
        LaunchConfigError: the port is taken or not allowed, with the OS error and the fix.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            raise LaunchConfigError(
                f"{flag} {port} cannot be used on this machine ({exc.strerror or exc}): another "
                "job probably listens on it. Pass a free port."
            ) from None


def usable_cpus() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def max_local_nproc() -> int:
    """The most processes a job on this machine may start (:data:`PROCS_PER_CPU` per core)."""
    return PROCS_PER_CPU * usable_cpus()


def check_nproc(nproc: int, *, local: bool, what: str) -> int:
    """Return ``nproc`` if one node can hold that many processes (see the module docstring).

    Args:
        nproc: processes per node.
        local: whether the node is this machine (then its cores give the bound).
        what: how the value was given, for the message (``"--nproc_per_node 100000"``).

    Raises:
        LaunchConfigError: too many processes, naming the bound and how it was derived.
    """
    if local:
        cpus = usable_cpus()
        limit = PROCS_PER_CPU * cpus
        if nproc > limit:
            raise LaunchConfigError(
                f"{what} asks for more processes than this machine can hold: at most "
                f"{PROCS_PER_CPU} per usable CPU core are started, {limit} here ({cpus} cores). "
                f"Pass a number up to {limit} (one per core or one per GPU is usual)."
            )
    elif nproc > REMOTE_MAX_NPROC:
        raise LaunchConfigError(
            f"{what} asks for more than {REMOTE_MAX_NPROC} processes per node, the most "
            "kolossos run starts on a remote node. Pass one per core or one per GPU of a node."
        )
    return nproc
