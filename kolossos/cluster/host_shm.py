"""Shared memory between the ranks of a gloo group that all run on one host.

gloo moves every byte between two processes on one host through a loopback socket: the sender
copies it into the kernel, the receiver out of it, and both pay the system calls. For the large
transfers of ZeRO's gradient reduction that is most of what the reduction costs on a CPU
(``python -m benchmarks.loopback_cost``; docs/benchmarks.md). :class:`HostSegments` gives every
rank of a group one file in ``/dev/shm`` that every other rank of the group maps too: a rank
writes into its own segment, tells a peer where with a one-element message over the process
group, and the peer reads the bytes in place.

The files are sparse: a range costs memory only between :meth:`HostSegments.reserve` (which
allocates it, so a full ``/dev/shm`` raises ``OSError`` there instead of killing the process
with ``SIGBUS`` at the first write) and :meth:`HostSegments.release` (which returns it to the
kernel). Each file is unlinked as soon as every rank has mapped it, so nothing is left in
``/dev/shm`` whatever way the job ends.

:func:`open_host_segments` decides, collectively, whether a group can use shared memory: gloo,
all ranks on one host (same host name and boot id), a writable ``/dev/shm`` with room for every
rank's segment, and ``KOLOSSOS_SHM`` not set to ``0``. Every rank gets the same answer.
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SHM_DIR", "SHM_ENV", "HostSegments", "open_host_segments"]

#: where the segments live (a tmpfs on Linux)
SHM_DIR = "/dev/shm"
#: ``KOLOSSOS_SHM=0`` keeps every transfer on the process group's own transport
SHM_ENV = "KOLOSSOS_SHM"


class HostSegments:
    """One shared segment per rank of a group, all mapped by every rank (see the module doc).

    Built by :func:`open_host_segments`.

    Args:
        rank: this rank in the group.
        fd: the open file of this rank's segment.
        maps: every rank's segment, mapped (this rank's included).
    """

    def __init__(self, rank: int, fd: int, maps: list[mmap.mmap]) -> None:
        self.rank = rank
        self.nbytes = len(maps[rank])
        self._fd = fd
        self._maps = maps
        # the maps unmap themselves when collected; the file closes with this object
        self._closer = weakref.finalize(self, os.close, fd)

    def view(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` of ``rank``'s segment (a tensor
        sharing the mapped memory: no copy; write only into this rank's own segment)."""
        nbytes = numel * dtype.itemsize
        assert offset >= 0 and offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._maps[rank], dtype=dtype, count=numel, offset=offset)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Allocate ``nbytes`` at ``offset`` of this rank's segment (page-aligned offset).

        Raises:
            RuntimeError: ``/dev/shm`` has no room left (names the fix).
        """
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as error:
            raise RuntimeError(
                f"{SHM_DIR} has no room for {nbytes} more bytes of this rank's shared segment "
                f"({error.strerror}); enlarge {SHM_DIR} (e.g. docker --shm-size) or set "
                f"{SHM_ENV}=0 to keep transfers on gloo's sockets."
            ) from error

    def release(self, offset: int, nbytes: int) -> None:
        """Give the pages of ``nbytes`` at ``offset`` of this rank's segment back to the kernel
        (they read as zeros until written again)."""
        self._maps[self.rank].madvise(mmap.MADV_REMOVE, offset, nbytes)

    def close(self) -> None:
        """Unmap every segment (views made by :meth:`view` must be gone)."""
        for segment in self._maps:
            segment.close()
        self._maps = []
        self._closer()


def _host_identity() -> tuple[str, str]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def _room(nbytes: int) -> int:
    """Bytes free in :data:`SHM_DIR` (0 when it is missing or read-only)."""
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return 0
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def _agree(group: dist.ProcessGroup | None, nbytes: int) -> bool:
    """COLLECTIVE: whether every rank of ``group`` can share ``nbytes`` segments."""
    world = dist.get_world_size(group)
    local: tuple[Any, ...] = (_host_identity(), os.environ.get(SHM_ENV, "1") != "0", _room(nbytes))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, local, group=group)  # SYNC POINT
    hosts = {entry[0] for entry in everyone}
    enabled = all(entry[1] for entry in everyone)
    # the ranks share one tmpfs: its free space must hold all of their segments, with margin
    return len(hosts) == 1 and enabled and min(entry[2] for entry in everyone) >= 2 * world * nbytes


def open_host_segments(group: dist.ProcessGroup | None, nbytes: int) -> HostSegments | None:
    """COLLECTIVE: map a shared segment of ``nbytes`` per rank of ``group``, or return ``None``
    on every rank when the group cannot share memory (see the module doc).

    Args:
        group: a gloo process group (``None``: the world).
        nbytes: size of each rank's segment (sparse: memory is taken by ``reserve``).

    Example:
        >>> segments = open_host_segments(None, 1 << 20)  # doctest: +SKIP
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" not in backend or dist.get_world_size(group) < 2 or nbytes <= 0:
        return None
    if not _agree(group, nbytes):
        return None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    path = os.path.join(SHM_DIR, f"kolossos-{uuid.uuid4().hex}-{rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        names: list[Any] = [None] * world
        dist.all_gather_object(names, path, group=group)  # SYNC POINT
        maps: list[mmap.mmap] = []
        for r, name in enumerate(names):
            if r == rank:
                maps.append(mmap.mmap(fd, nbytes, mmap.MAP_SHARED))
                continue
            peer = os.open(name, os.O_RDWR)
            try:
                maps.append(mmap.mmap(peer, nbytes, mmap.MAP_SHARED))
            finally:
                os.close(peer)
        dist.barrier(group=group)  # SYNC POINT: every rank mapped every segment
    finally:
        os.unlink(path)
    return HostSegments(rank, fd, maps)
