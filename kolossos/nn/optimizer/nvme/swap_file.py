"""The file that holds offloaded optimizer states, with positional reads and writes into tensors.

A :class:`SwapFile` is created, checked and fully reserved when the optimizer is built, so a
directory that cannot be written or a disk that is too small fails before training starts, with
a message that says what to change. The file is unlinked right after it is opened: it needs no
cleanup, and a crashed or killed run leaves nothing behind. A private temporary directory (when
none is given) is removed when the file is closed, at the latest at interpreter exit.

I/O is plain ``os.preadv``/``os.pwrite`` on the tensor's own memory (no copies, no native
dependency); both release the GIL, so background threads overlap them with computation.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

__all__ = ["NVMeOffloadError", "SwapFile"]

#: free space kept in reserve beyond the states themselves
SPACE_MARGIN = 64 << 20


class NVMeOffloadError(OSError):
    """The offload directory cannot hold the optimizer states (unwritable, full, missing)."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


class SwapFile:
    """A reserved, already-unlinked file of ``nbytes`` bytes in ``directory``.

    Args:
        directory: where to put it; ``None`` creates a private temporary directory.
        nbytes: bytes to reserve.

    Raises:
        NVMeOffloadError: the directory cannot be created or written, or has too little space.

    Example:
        >>> swap = SwapFile(None, 8)
        >>> t = torch.arange(2, dtype=torch.float32)
        >>> swap.write(0, t.view(torch.uint8))
        >>> out = torch.empty(8, dtype=torch.uint8)
        >>> swap.read(0, out)
        >>> out.view(torch.float32).tolist()
        [0.0, 1.0]
        >>> swap.close()
    """

    def __init__(self, directory: str | os.PathLike[str] | None, nbytes: int) -> None:
        self.nbytes = nbytes
        self._private = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="kolossos-nvme-")
        self.directory = Path(directory)
        try:
            self._fd = _open_reserved(self.directory, nbytes)
        except BaseException:
            if self._private:
                shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(
            self, _release, self._fd, self.directory if self._private else None, os.getpid()
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return not self._finalizer.alive

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU ``uint8`` tensor ``out`` from bytes starting at ``offset``."""
        view = _buffer(out)
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise NVMeOffloadError(errno.EIO, f"short read from the swap file at {offset}")
            done += n

    def write(self, offset: int, data: torch.Tensor) -> None:
        """Write the contiguous CPU ``uint8`` tensor ``data`` at byte ``offset``."""
        view = _buffer(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def close(self) -> None:
        """Close the file (and remove a private directory). Idempotent."""
        self._finalizer()


def _buffer(t: torch.Tensor) -> memoryview:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
        raise TypeError("swap I/O needs a contiguous CPU uint8 tensor")
    return t.numpy().data.cast("B")


def _open_reserved(directory: Path, nbytes: int) -> int:
    """Create, unlink and reserve the file; every failure becomes an :class:`NVMeOffloadError`."""
    fix = "choose another nvme_offload_dir or lower nvme_offload_fraction"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="kolossos-optim-", suffix=".swap", dir=directory)
    except OSError as exc:
        raise NVMeOffloadError(
            exc.errno, f"nvme_offload_dir={str(directory)!r} cannot be written ({exc}); {fix}"
        ) from exc
    os.unlink(name)  # the open descriptor keeps the data; nothing to clean up on any exit
    try:
        free = shutil.disk_usage(directory).free
        if free < nbytes + SPACE_MARGIN:
            raise NVMeOffloadError(
                errno.ENOSPC,
                f"nvme_offload_dir={str(directory)!r} has {_gib(free)} free, but offloading the "
                f"optimizer states needs {_gib(nbytes)} (+{_gib(SPACE_MARGIN)} margin); "
                f"free space, {fix}",
            )
        _reserve(fd, nbytes, directory, fix)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reserve(fd: int, nbytes: int, directory: Path, fix: str) -> None:
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise NVMeOffloadError(
                errno.ENOSPC,
                f"nvme_offload_dir={str(directory)!r}: the disk is full, {_gib(nbytes)} of "
                f"optimizer states do not fit; {fix}",
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise NVMeOffloadError(exc.errno, f"cannot reserve the swap file: {exc}") from exc
        os.ftruncate(fd, nbytes)  # filesystems without fallocate: a sparse file
    except AttributeError:  # platforms without posix_fallocate
        os.ftruncate(fd, nbytes)


def _release(fd: int, private_dir: Path | None, owner_pid: int) -> None:
    os.close(fd)
    if private_dir is not None and os.getpid() == owner_pid:  # never from a forked child
        shutil.rmtree(private_dir, ignore_errors=True)
