"""Host names, hostfiles and node selection for ``kolossos run``.

Hostfile format (one node per line)::

    # comments start with '#', blank lines are ignored
    node1
    node2 slots=4      # optional: processes to start on this node
    10.0.0.7 slots=4

``slots=N`` is the only option a line may carry (the OpenMPI / DeepSpeed spelling). A host may
appear only once (names are compared without case, addresses in canonical form). Host names must
look like a DNS name or an IP address: this keeps a hostfile from smuggling ssh options
(``-oProxyCommand=...``) or shell syntax into the launch commands.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kolossos.cli.launcher.errors import LaunchConfigError

# RFC 1123 labels; '_' is tolerated because some clusters use it in node names.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_ZONE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


@dataclass(frozen=True, kw_only=True)
class HostEntry:
    """One node of a hostfile or ``--host`` list."""

    host: str
    """The host name or IP address, as given (validated by :func:`validate_hostname`)."""
    slots: int | None = None
    """The process count from ``slots=N``; ``None`` when the line gave none."""


def validate_hostname(name: str, *, what: str = "host") -> str:
    """Return ``name`` if it is a plausible host name or IP address, else raise.

    Args:
        name: a DNS name (``node-1``, ``gpu1.cluster.local``) or an IPv4/IPv6 address.
        what: how to call the value in the error message (``"host"``, ``"--master_addr"``...).

    Returns:
        The name unchanged.

    Raises:
        LaunchConfigError: for an empty name, one starting with ``-``, one holding spaces, shell
            characters, ``user@`` or a port, or one longer than 253 characters.
    """
    try:
        ipaddress.ip_address(name)
        # an IPv6 zone ("fe80::1%eth0") may hold anything to ipaddress; allow interface names only
        if _ZONE_RE.fullmatch(name.partition("%")[2] or "x"):
            return name
    except ValueError:
        pass
    if len(name) <= 253 and _HOSTNAME_RE.fullmatch(name) and not name.startswith("-"):
        return name
    raise LaunchConfigError(
        f"{what} {name!r} is not a valid host name: a host must be a DNS name (letters, digits, "
        "'-', '_' and '.', not starting with '-') or an IP address. Fix the name; put a user name "
        "or port in ~/.ssh/config (or use --ssh-port) instead of writing them into the host."
    )


def host_key(host: str) -> str:
    """The identity of a host name for duplicate checks: DNS names ignore case and a final
    dot, IP addresses are compared in their canonical form (``0::1`` is ``::1``)."""
    address, sep, zone = host.partition("%")
    try:
        return ipaddress.ip_address(address).compressed + sep + zone
    except ValueError:
        return host.lower().rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface (``localhost``, ``127.x.y.z``, ``::1``)."""
    if host.lower().rstrip(".") in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_host(host: str) -> bool:
    """Whether ``host`` is this machine: a loopback name or this machine's own host name.

    No DNS lookup is made (it could hang); an IP address of a non-loopback interface is therefore
    treated as remote.
    """
    if is_loopback(host):
        return True
    own = socket.gethostname().lower()
    name = host.lower().rstrip(".")
    return name in (own, own.split(".")[0])


def parse_hostfile_text(text: str, *, source: str = "hostfile") -> list[HostEntry]:
    """Parse the text of a hostfile (see the module docstring for the format).

    Args:
        text: the file content.
        source: the file name used in error messages.

    Returns:
        The entries in file order.

    Raises:
        LaunchConfigError: for a malformed line, a duplicate host or a file without hosts.
    """
    entries: list[HostEntry] = []
    seen: dict[str, tuple[str, int]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        host, *options = line.split()
        validate_hostname(host, what=f"{where}: host")
        slots = None
        for option in options:
            if slots is not None:
                raise LaunchConfigError(
                    f"{where}: host {host!r} has more than one option ({' '.join(options)}); "
                    "write a single 'slots=N'."
                )
            slots = _parse_slots(option, where=where, host=host)
        key = host_key(host)
        if key in seen:
            first, line_no = seen[key]
            same = "" if first == host else f" (as {first!r}: host names ignore case)"
            raise LaunchConfigError(
                f"{where}: host {host!r} is listed twice{same} (first on line {line_no}); each "
                "node may appear once. Remove the duplicate line ($PBS_NODEFILE repeats a host "
                "per slot: write 'sort -u $PBS_NODEFILE > hostfile')."
            )
        seen[key] = (host, lineno)
        entries.append(HostEntry(host=host, slots=slots))
    if not entries:
        raise LaunchConfigError(
            f"{source}: the hostfile lists no hosts; write one host name per line "
            "(optionally 'host slots=N')."
        )
    return entries


def _parse_slots(option: str, *, where: str, host: str) -> int:
    key, sep, value = option.partition("=")
    if key != "slots" or not sep:
        raise LaunchConfigError(
            f"{where}: unexpected {option!r} after host {host!r}; a line holds a host name and "
            "optionally 'slots=N' (e.g. 'node1 slots=4'). Remove or fix the extra text."
        )
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise LaunchConfigError(
            f"{where}: {option!r} for host {host!r} is not a positive integer; "
            "write e.g. 'slots=4'."
        )
    return int(value)


def read_hostfile(path: str | Path) -> list[HostEntry]:
    """Read and parse the hostfile at ``path``.

    Raises:
        LaunchConfigError: if the file cannot be read or is empty or malformed.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LaunchConfigError(
            f"--hostfile {str(path)!r} cannot be read ({exc.__class__.__name__}: {exc}); pass the "
            "path of a readable text file with one host per line."
        ) from exc
    return parse_hostfile_text(text, source=str(path))


def parse_name_list(value: str, *, what: str) -> list[str]:
    """Split a comma-separated list of host names (``--host``, ``--include``, ``--exclude``).

    Raises:
        LaunchConfigError: for an empty item, an invalid name or a repeated name.
    """
    names = [item.strip() for item in value.split(",")]
    if not value.strip() or any(not name for name in names):
        raise LaunchConfigError(
            f"{what} {value!r} has an empty host name; write comma-separated names without "
            "spaces or empty items, e.g. 'node1,node2'."
        )
    for name in names:
        validate_hostname(name, what=f"{what}: host")
    keys = [host_key(name) for name in names]
    duplicates = sorted(
        {name for name, key in zip(names, keys, strict=True) if keys.count(key) > 1}
    )
    if duplicates:
        raise LaunchConfigError(
            f"{what} {value!r} repeats {', '.join(duplicates)}; list each host once (host names "
            "ignore case)."
        )
    return names


def select_hosts(
    entries: Sequence[HostEntry],
    *,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    num_nodes: int = -1,
) -> list[HostEntry]:
    """Apply ``--include``/``--exclude`` and then ``--num_nodes`` to hostfile entries.

    The result keeps the hostfile's order; ``num_nodes`` (``-1`` = all) takes the first hosts left.

    Raises:
        LaunchConfigError: for both include and exclude, a name not in the hostfile, no host left,
            or ``num_nodes`` that is 0, below -1 or larger than the hosts left.
    """
    include, exclude = list(include or ()), list(exclude or ())
    if include and exclude:
        raise LaunchConfigError(
            "--include and --exclude were both given; they are mutually exclusive. Use --include "
            "to list the hosts to run on, or --exclude to list the hosts to skip."
        )
    known = [entry.host for entry in entries]
    keys = {host_key(host) for host in known}
    for flag, names in (("--include", include), ("--exclude", exclude)):
        unknown = [name for name in names if host_key(name) not in keys]
        if unknown:
            raise LaunchConfigError(
                f"{flag} names {', '.join(map(repr, unknown))}, which the hostfile does not list "
                f"(it lists {', '.join(known)}); fix the name or add the host to the hostfile."
            )
    wanted, skipped = {host_key(h) for h in include}, {host_key(h) for h in exclude}
    chosen = [
        e
        for e in entries
        if (not include or host_key(e.host) in wanted) and host_key(e.host) not in skipped
    ]
    if not chosen:
        raise LaunchConfigError(
            f"--exclude {','.join(exclude)} removes every host of the hostfile; leave at least one."
        )
    if num_nodes == 0 or num_nodes < -1:
        raise LaunchConfigError(
            f"--num_nodes {num_nodes} is invalid: it must be a positive node count, or -1 for all "
            "hosts of the hostfile."
        )
    if num_nodes > len(chosen):
        raise LaunchConfigError(
            f"--num_nodes {num_nodes} is larger than the {len(chosen)} host(s) available "
            f"({', '.join(e.host for e in chosen)}); lower --num_nodes or add hosts."
        )
    return chosen if num_nodes == -1 else chosen[:num_nodes]
