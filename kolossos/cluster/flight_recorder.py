"""Which collective each rank entered last, read from torch's flight recorder, and who is behind.

torch records every collective a process group starts in a ring buffer (its "flight recorder":
``TORCH_FR_BUFFER_SIZE`` entries; gloo and NCCL). :func:`enable` turns it on before the process
group is created; :func:`local_collectives` summarises this process's buffer as the last collective
of each group (kind, sequence number, when it started); :func:`stragglers` compares those
summaries across ranks and names the ranks that never entered a collective their peers are
waiting in, which :func:`describe` prints as a table. The summaries travel between ranks in the
heartbeats of :mod:`kolossos.cluster.watchdog`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "DEFAULT_ENTRIES",
    "LastCollective",
    "describe",
    "enable",
    "from_dict",
    "local_collectives",
    "stragglers",
    "to_dict",
]

#: flight-recorder entries kept per process when the user did not choose (torch's NCCL default)
DEFAULT_ENTRIES = 2000
_ENV_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


@dataclass(frozen=True)
class LastCollective:
    """The last collective this rank started in one process group."""

    group: str
    """The group's description (``default_pg`` for the world) and its id, e.g. ``default_pg#0``."""
    ranks: list[int]
    """The group's members (global ranks)."""
    seq: int
    """Its sequence number in the group (1 for the first; 0: none started yet)."""
    kind: str
    """What it was, e.g. ``gloo:all_reduce`` or ``nccl:send 0->1``."""
    started: float
    """When it started (seconds since the epoch; 0 when none started)."""
    state: str
    """The backend's word for it: NCCL reports ``started`` and ``completed``; gloo records
    ``scheduled`` only (completion unknown)."""


def enable(environ: MutableMapping[str, str] | None = None) -> None:
    """Turn torch's flight recorder on for process groups created from now on, unless the user
    chose a buffer size (``0`` turns it off)."""
    env = os.environ if environ is None else environ
    if not any(name in env for name in _ENV_NAMES):  # the second is the deprecated NCCL name
        env[_ENV_NAMES[0]] = str(DEFAULT_ENTRIES)


def _dump() -> dict[str, Any] | None:
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:  # a torch without a flight recorder
        return None
    try:
        data = json.loads(dump(True, False))
    except (RuntimeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ranks(text: Any) -> list[int]:
    try:
        return [int(r) for r in json.loads(text)] if isinstance(text, str) else list(text)
    except (ValueError, TypeError):
        return []


def local_collectives() -> dict[str, LastCollective] | None:
    """This process's last collective in every process group it belongs to (a group without a
    collective yet has ``seq == 0``); ``None`` when torch keeps no flight record."""
    data = _dump()
    if data is None:
        return None
    groups: dict[str, dict[str, Any]] = {}
    for name, cfg in (data.get("pg_config") or {}).items():
        if str(name) and cfg.get("desc"):  # torch lists an unnamed placeholder too
            groups[str(name)] = {"desc": cfg["desc"], "ranks": _ranks(cfg.get("ranks"))}
    out: dict[str, LastCollective] = {}
    for name, cfg in groups.items():
        key = f"{cfg['desc']}#{name}"
        out[key] = LastCollective(key, cfg["ranks"], 0, "", 0.0, "")
    for entry in data.get("entries") or []:
        name, desc = [*(entry.get("process_group") or []), "?", "?"][:2]
        key = f"{desc}#{name}"
        p2p = bool(entry.get("is_p2p"))
        seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
        if p2p:
            key += ":p2p"  # point-to-point numbers count separately from collectives
        ranks = groups.get(str(name), {}).get("ranks", [])
        last = LastCollective(
            group=key,
            ranks=ranks,
            seq=seq,
            kind=str(entry.get("profiling_name", "?")),
            started=float(entry.get("time_created_ns") or 0) / 1e9,
            state=str(entry.get("state", "")),
        )
        if key not in out or seq >= out[key].seq:
            out[key] = last
    return out


def to_dict(collectives: Mapping[str, LastCollective]) -> dict[str, Any]:
    """A JSON-ready form of :func:`local_collectives`'s answer."""
    return {key: asdict(value) for key, value in collectives.items()}


def from_dict(data: Mapping[str, Any]) -> dict[str, LastCollective]:
    """The inverse of :func:`to_dict` (entries that do not fit are skipped)."""
    out = {}
    for key, value in data.items():
        try:
            out[key] = LastCollective(**value)
        except TypeError:
            continue
    return out


def stragglers(every: Mapping[int, Mapping[str, LastCollective]]) -> dict[int, str]:
    """The ranks that are behind their peers, each with the reason.

    A rank is behind in a group when a peer of that group started a collective with a higher
    sequence number: the peer waits in it for this rank, which never arrived. Point-to-point
    numbers are per pair of ranks and are not compared.

    Args:
        every: each rank's :func:`local_collectives`.
    """
    behind: dict[int, str] = {}
    keys = {key for groups in every.values() for key in groups}
    for key in sorted(k for k in keys if not k.endswith(":p2p")):
        seen = {rank: groups[key] for rank, groups in every.items() if key in groups}
        lead_rank, lead = max(seen.items(), key=lambda item: item[1].seq)
        for rank, last in seen.items():
            if last.seq < lead.seq and rank not in behind:
                behind[rank] = (
                    f"rank {lead_rank} started collective #{lead.seq} ({lead.kind}) of group "
                    f"{key}, which rank {rank} never entered (its last there: #{last.seq})"
                )
    return behind


def describe(every: Mapping[int, Mapping[str, LastCollective]], now: float | None = None) -> str:
    """A table of every rank's last collective per group, the ranks behind marked."""
    now = time.time() if now is None else now
    behind = stragglers(every)
    lines = ["last collective of every rank (torch flight recorder):"]
    keys = sorted({key for groups in every.values() for key in groups})
    for key in keys:
        lines.append(f"  group {key}:")
        for rank in sorted(every):
            last = every[rank].get(key)
            if last is None:
                continue
            if last.seq == 0:
                what = "none started"
            else:
                age = f"{max(0.0, now - last.started):.1f} s ago" if last.started else "?"
                state = f", {last.state}" if last.state in ("started", "completed") else ""
                what = f"#{last.seq} {last.kind}, started {age}{state}"
            lagging = rank in behind and last.seq < _lead(every, key) and ":p2p" not in key
            mark = "   <- behind" if lagging else ""
            lines.append(f"    rank {rank}: {what}{mark}")
    for rank, why in sorted(behind.items()):
        lines.append(f"  rank {rank} is behind: {why}")
    return "\n".join(lines)


def _lead(every: Mapping[int, Mapping[str, LastCollective]], key: str) -> int:
    return max((groups[key].seq for groups in every.values() if key in groups), default=0)
