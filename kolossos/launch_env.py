"""Pure helpers behind :mod:`kolossos.initialize`: reading launcher environments, choosing the
communication backend and the collective timeout.

Nothing here touches ``torch.distributed``: every rule is unit-testable without a process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Default collective timeout. torch's own default is 30 minutes, long enough for a lost rank to
#: look like a hang; 10 minutes still covers a slow first checkpoint gather over gloo.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "KOLOSSOS_DIST_TIMEOUT"
#: the progress watchdog's time in seconds (unset or 0: off); see kolossos.cluster.watchdog
WATCHDOG_ENV = "KOLOSSOS_WATCHDOG"
KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc")

ConfigLike = dict[str, Any] | str | os.PathLike[str] | None


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Where this process sits in the job, as a launcher described it."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int | None = None
    """Rank on this node (selects the device); ``None`` when the launcher does not say."""
    host: str | None = None
    """Address of the rendezvous (rank 0's) host, when the launcher provides it."""
    port: int | None = None
    """Port of the rendezvous, when the launcher provides it."""


def _read_int(env: Mapping[str, str], name: str, launcher: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise RuntimeError(
            f"environment variable {name} is not set, so this process was not started by "
            f"{launcher}. Start the script with {launcher}, or call kolossos.launch(...) with "
            "explicit rank, world_size, host and port."
        )
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(
            f"environment variable {name}={raw!r} is not an integer; {launcher} sets it to the "
            "process's rank or count. Unset it or fix the launcher configuration."
        ) from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...], launcher: str) -> int:
    for name in names:
        if name in env:
            return _read_int(env, name, launcher)
    return _read_int(env, names[0], launcher)


def env_from_torch(env: Mapping[str, str] | None = None) -> RankInfo:
    """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.

    These are set by ``torchrun``, ``python -m torch.distributed.launch`` and ``kolossos run``.

    Raises:
        RuntimeError: a variable is missing or not an integer (the message names it).
    """
    env = os.environ if env is None else env
    launcher = "torchrun or `kolossos run`"
    rank = _read_int(env, "RANK", launcher)
    world_size = _read_int(env, "WORLD_SIZE", launcher)
    local_rank = _read_int(env, "LOCAL_RANK", launcher)
    port = _read_int(env, "MASTER_PORT", launcher)
    host = env.get("MASTER_ADDR")
    if not host:
        _read_int(env, "MASTER_ADDR", launcher)  # raises the uniform "not set" error
    return RankInfo(rank=rank, world_size=world_size, local_rank=local_rank, host=host, port=port)


def env_from_slurm(env: Mapping[str, str] | None = None) -> RankInfo:
    """Read ``SLURM_PROCID`` (rank), ``SLURM_NPROCS`` or ``SLURM_NTASKS`` (world size) and
    ``SLURM_LOCALID`` (local rank, optional)."""
    env = os.environ if env is None else env
    launcher = "srun (SLURM)"
    rank = _read_int(env, "SLURM_PROCID", launcher)
    world_size = _first_int(env, ("SLURM_NPROCS", "SLURM_NTASKS"), launcher)
    local = _read_int(env, "SLURM_LOCALID", launcher) if "SLURM_LOCALID" in env else None
    return RankInfo(rank=rank, world_size=world_size, local_rank=local)


def env_from_openmpi(env: Mapping[str, str] | None = None) -> RankInfo:
    """Read ``OMPI_COMM_WORLD_RANK``, ``_SIZE`` and ``_LOCAL_RANK`` (set by Open MPI)."""
    env = os.environ if env is None else env
    launcher = "mpirun (Open MPI)"
    return RankInfo(
        rank=_read_int(env, "OMPI_COMM_WORLD_RANK", launcher),
        world_size=_read_int(env, "OMPI_COMM_WORLD_SIZE", launcher),
        local_rank=_read_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", launcher),
    )


def validate_rank_info(info: RankInfo) -> None:
    """Check the numbers a launcher (or the caller) gave before any collective is attempted.

    Raises:
        ValueError: world size < 1, rank outside ``[0, world_size)``, a negative local rank, or a
            port outside ``[1, 65535]``.
    """
    if info.world_size < 1:
        raise ValueError(f"world_size={info.world_size} must be at least 1.")
    if not 0 <= info.rank < info.world_size:
        raise ValueError(
            f"rank={info.rank} must lie in [0, world_size={info.world_size}); every process needs "
            "a distinct rank below the world size."
        )
    if info.local_rank is not None and info.local_rank < 0:
        raise ValueError(f"local_rank={info.local_rank} must be >= 0.")
    if info.port is not None and not 1 <= info.port <= 65535:
        raise ValueError(f"port={info.port} must lie in [1, 65535]; pick a free TCP port.")
    if info.host is not None and not info.host.strip():
        raise ValueError("host is empty; pass the address of the rank-0 machine, e.g. '127.0.0.1'.")


def validate_config(config: ConfigLike) -> dict[str, Any] | Path:
    """Check the ``config`` argument of :func:`kolossos.launch`: a dict, or a config-file path.

    Returns:
        A copy of the dict (``None`` gives ``{}``), or the resolved path of the file.

    Raises:
        TypeError: ``config`` is neither a dict nor a path.
        FileNotFoundError: the path does not name an existing file.
    """
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"config file {str(path)!r} does not exist; pass an existing file (e.g. "
                "'./config.py') or a dict such as config={}."
            )
        return path.resolve()
    raise TypeError(
        f"config must be a dict or a path to a config file, got {type(config).__name__}; "
        "pass config={} when you have no configuration."
    )


def resolve_backend(backend: str | None, cuda_available: bool) -> tuple[str, str | None]:
    """Choose the communication backend.

    ``None`` picks ``nccl`` with CUDA and ``gloo`` without. An explicit ``nccl`` on a machine
    without CUDA falls back to ``gloo`` so the documented (CUDA-only) examples run on CPU.

    Returns:
        ``(backend, warning)``: the warning text is ``None`` unless a fallback happened.

    Raises:
        ValueError: an unknown backend name.
    """
    if backend is None:
        return ("nccl" if cuda_available else "gloo"), None
    name = backend.lower()
    if name not in KNOWN_BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not a torch.distributed backend; use one of "
            f"{', '.join(KNOWN_BACKENDS)} or None to choose automatically."
        )
    if name == "nccl" and not cuda_available:
        return "gloo", "backend='nccl' needs CUDA, which is not available here; using 'gloo'."
    return name, None


def resolve_timeout(
    timeout: float | timedelta | None, env: Mapping[str, str] | None = None
) -> timedelta:
    """The collective timeout: the argument, else ``$KOLOSSOS_DIST_TIMEOUT`` (seconds), else 600 s.

    Raises:
        ValueError: a non-positive or non-numeric timeout.
    """
    env = os.environ if env is None else env
    if timeout is None:
        raw = env.get(TIMEOUT_ENV)
        if raw is None:
            return timedelta(seconds=DEFAULT_TIMEOUT_S)
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set e.g. {TIMEOUT_ENV}=600."
            ) from None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout={seconds} s must be positive; e.g. 600 for ten minutes.")
    return timedelta(seconds=seconds)


def init_method_url(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def parse_watchdog(raw: str, what: str = WATCHDOG_ENV) -> float | None:
    """A watchdog time in seconds from text; ``None`` for ``""`` or ``0`` (off).

    Raises:
        ValueError: not a finite number >= 0 (naming ``what``, the rule and the fix).
    """
    text = raw.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise ValueError(
            f"{what}={raw!r} is not a number of seconds >= 0; give how long a rank may make no "
            "progress while its peers moved on (e.g. 300), or 0 to turn the watchdog off."
        )
    return value or None


def watchdog_seconds(env: Mapping[str, str] | None = None) -> float | None:
    """The watchdog time from :data:`WATCHDOG_ENV` (``None``: off).

    Raises:
        ValueError: a value that is not a number of seconds >= 0.
    """
    return parse_watchdog((os.environ if env is None else env).get(WATCHDOG_ENV, ""))
