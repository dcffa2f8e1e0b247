"""Start the distributed environment: environment → ``init_process_group`` → device → seed.

The four entry points differ only in where rank, world size and rendezvous address come from:

* :func:`launch` — all given explicitly (``get_default_parser()`` reads them from the command line);
* :func:`launch_from_torch` — ``torchrun`` / ``kolossos run`` variables;
* :func:`launch_from_slurm` — ``srun`` variables, host and port given;
* :func:`launch_from_openmpi` — ``mpirun`` variables, host and port given.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from kolossos.accelerator import get_accelerator
from kolossos.cluster import flight_recorder
from kolossos.cluster.rank_failure import install_failure_hook
from kolossos.cluster.watchdog import start_heartbeat
from kolossos.launch_env import (
    ConfigLike,
    RankInfo,
    env_from_openmpi,
    env_from_slurm,
    env_from_torch,
    init_method_url,
    resolve_backend,
    resolve_timeout,
    validate_config,
    validate_rank_info,
    watchdog_seconds,
)
from kolossos.logging import get_dist_logger
from kolossos.utils.seed import set_seed

_launch_config: dict[str, Any] | Path | None = None


class LaunchHook(Protocol):
    """What a higher layer (the legacy global context) plugs into :func:`launch`."""

    def check(self, config: dict[str, Any] | Path, world_size: int) -> None:
        """Called before the rendezvous with the checked ``config``: raise on a bad one."""

    def launched(self, rank: int, world_size: int, seed: int) -> None:
        """Called on every rank once the default group exists and the RNGs are seeded."""


_launch_hooks: list[LaunchHook] = []


def add_launch_hook(hook: LaunchHook) -> None:
    """Have every later :func:`launch` call ``hook`` (once, however often it is added).

    The launcher stays ignorant of what builds on it: ``kolossos.legacy`` adds the hook that
    fills the global context ``gpc`` (see ``docs/legacy.md``).
    """
    if all(h is not hook for h in _launch_hooks):
        _launch_hooks.append(hook)


def get_launch_config() -> dict[str, Any] | Path | None:
    """The ``config`` of the last launch: a dict, a config-file path, or ``None`` before launch."""
    return _launch_config


def get_default_parser() -> argparse.ArgumentParser:
    """An ``argparse`` parser with the launch arguments; add your own with ``add_argument``.

    Arguments: ``--config``, ``--host``, ``--port``, ``--world_size``, ``--rank``, ``--local_rank``,
    ``--backend`` (default ``None``: nccl with CUDA, gloo without; ``nccl`` without CUDA falls back
    to gloo with a warning).

    Example:
        >>> parser = get_default_parser()
        >>> args = parser.parse_args(["--rank", "0", "--world_size", "1"])
        >>> args.port
        29500
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, help="path to the config file")
    parser.add_argument("--host", type=str, default="127.0.0.1", help="the master address")
    parser.add_argument("--port", type=int, default=29500, help="the master port")
    parser.add_argument("--world_size", type=int, help="world size for distributed training")
    parser.add_argument("--rank", type=int, help="rank for the default process group")
    parser.add_argument("--local_rank", type=int, help="local rank on the node")
    parser.add_argument(
        "--backend",
        type=str,
        default=None,
        help="communication backend: gloo, nccl, mpi (default: nccl with CUDA, gloo without)",
    )
    return parser


def launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """Initialise the default process group, pick this process's device and seed every RNG.

    Args:
        config: a dict (may be empty) or the path of a config file; kept for the config-file
            features (:func:`get_launch_config`). Through ``kolossos.launch`` it also fills
            the legacy global context ``gpc``, building the groups of a ``parallel`` key.
        rank: global rank of this process.
        world_size: number of processes.
        host: address of the rank-0 machine.
        port: free TCP port on ``host`` for the rendezvous.
        backend: ``None`` (nccl with CUDA, gloo without), or an explicit backend name.
        local_rank: rank on this node; selects the accelerator device. Defaults to
            ``rank % device_count``.
        seed: seed for python, numpy and torch (identical on every rank, so models built after
            launch start identical everywhere).
        verbose: log a line on rank 0 once the environment is up.
        timeout: collective timeout in seconds (or a ``timedelta``); default
            ``$KOLOSSOS_DIST_TIMEOUT`` or 600 s. A lost rank then surfaces as an error, not a hang.

    With several processes, each rank also gets torch's flight recorder (unless
    ``TORCH_FR_BUFFER_SIZE`` is set), a heartbeat thread with the optional progress watchdog
    (``KOLOSSOS_WATCHDOG`` seconds) and a hook that reports an uncaught exception with the rank
    and bounds the shutdown after it (see ``docs/reliability.md``).

    Raises:
        TypeError / FileNotFoundError: bad ``config``.
        ValueError: bad rank, world size, port, backend, timeout or ``KOLOSSOS_WATCHDOG``, or
            (through the legacy hook) a broken ``parallel`` rule.
        RuntimeError: already initialised with a different rank or world size.
    """
    global _launch_config
    checked_config = validate_config(config)
    info = RankInfo(rank=rank, world_size=world_size, local_rank=local_rank, host=host, port=port)
    validate_rank_info(info)
    accelerator = get_accelerator()
    chosen, warning = resolve_backend(backend, accelerator.name == "cuda")
    if warning is not None:
        warnings.warn(warning, RuntimeWarning, stacklevel=2)
    pg_timeout = resolve_timeout(timeout)
    watchdog_seconds()  # a bad KOLOSSOS_WATCHDOG fails here, before the rendezvous
    for hook in _launch_hooks:
        hook.check(checked_config, world_size)  # a bad config fails here, on every rank

    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}; call "
                "torch.distributed.destroy_process_group() first or launch only once."
            )
        warnings.warn(
            "torch.distributed is already initialised; kolossos.launch reuses the existing "
            "default process group.",
            RuntimeWarning,
            stacklevel=2,
        )
    else:
        flight_recorder.enable()  # before the group exists: it records from its creation
        # SYNC POINT: the rendezvous blocks until every rank has arrived (or pg_timeout passes).
        dist.init_process_group(
            backend=chosen,
            init_method=init_method_url(host, port),
            rank=rank,
            world_size=world_size,
            timeout=pg_timeout,
        )

    if accelerator.name != "cpu":
        count = max(accelerator.device_count(), 1)
        accelerator.set_device(rank % count if local_rank is None else local_rank)

    if world_size > 1:
        start_heartbeat(rank, world_size, host, port)
        install_failure_hook(rank)
        if not _teardown_registered:
            _teardown_registered.append(True)
            atexit.register(_destroy_at_exit)
    set_seed(seed)
    _launch_config = checked_config
    for hook in _launch_hooks:
        hook.launched(rank, world_size, seed)  # may be COLLECTIVE (new_group on every rank)
    if verbose:
        get_dist_logger().info(
            f"Distributed environment is initialized: world size {world_size}, backend {chosen}, "
            f"device {accelerator.get_current_device()}, timeout {pg_timeout.total_seconds():g} s",
            ranks=[0],
        )


_teardown_registered: list[bool] = []


def _destroy_at_exit() -> None:
    """Destroy the default process group before the interpreter tears down. Left to the
    interpreter, gloo's destructors abort the process now and then (seen in ~1 of 5 two-rank
    runs whose ranks exit at different moments; never after an explicit destroy)."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _launch_from(
    info: RankInfo,
    config: ConfigLike,
    host: str,
    port: int,
    backend: str | None,
    seed: int,
    verbose: bool,
    timeout: float | timedelta | None,
) -> None:
    launch(
        config=config,
        rank=info.rank,
        world_size=info.world_size,
        host=host,
        port=port,
        backend=backend,
        local_rank=info.local_rank,
        seed=seed,
        verbose=verbose,
        timeout=timeout,
    )


def launch_from_torch(
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """:func:`launch` with rank, world size and address read from ``torchrun`` / ``kolossos run``
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    Example:
        >>> # run with: kolossos run --nproc_per_node 2 train.py
        >>> kolossos.launch_from_torch(config={})  # doctest: +SKIP
    """
    info = env_from_torch()
    assert info.host is not None and info.port is not None
    _launch_from(info, config, info.host, info.port, backend, seed, verbose, timeout)


def launch_from_slurm(
    config: ConfigLike,
    host: str,
    port: int,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """:func:`launch` with rank and world size read from SLURM (``SLURM_PROCID``, ``SLURM_NPROCS``).

    Example:
        >>> # srun python train.py --host <master node> --port 29500
        >>> kolossos.launch_from_slurm(config={}, host=args.host, port=args.port)  # doctest: +SKIP
    """
    info = env_from_slurm()
    _launch_from(info, config, host, port, backend, seed, verbose, timeout)


def launch_from_openmpi(
    config: ConfigLike,
    host: str,
    port: int,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """:func:`launch` with ranks read from Open MPI (``OMPI_COMM_WORLD_RANK``, ``_SIZE``,
    ``_LOCAL_RANK``).

    Example:
        >>> # mpirun --hostfile hosts -np 8 python train.py --host <node> --port 29500
        >>> kolossos.launch_from_openmpi({}, host=args.host, port=args.port)  # doctest: +SKIP
    """
    info = env_from_openmpi()
    _launch_from(info, config, host, port, backend, seed, verbose, timeout)


def is_launched() -> bool:
    """Whether the default process group exists."""
    return bool(dist.is_available() and dist.is_initialized())


__all__ = [
    "LaunchHook",
    "add_launch_hook",
    "get_default_parser",
    "get_launch_config",
    "is_launched",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]
