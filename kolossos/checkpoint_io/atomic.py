"""Crash-safe writes: a file or a whole checkpoint directory appears complete, or not at all.

Files are written under a temporary name in their final directory, flushed, ``fsync``-ed and
renamed over the target (``os.replace`` is atomic on POSIX), then the directory is ``fsync``-ed so
the rename itself survives a power cut.

A directory checkpoint is built in a fresh *staging* directory next to the target
(``.<name>.kolossos-staging``) and swapped in at the end. On Linux the swap is a single
``renameat2(RENAME_EXCHANGE)``; elsewhere the old directory is first renamed to
``.<name>.kolossos-old`` and readers fall back to it while the target is absent
(:func:`readable_directory`). Files in the old directory that the new checkpoint does not own (for
example an optimizer checkpoint saved into the same directory as the model) are carried over by hard
links before the swap. Until the swap the old checkpoint is untouched, so a crash or an exception
at any point leaves it loadable.

Example:
    >>> with atomic_file(Path("out/weights.bin")) as tmp:
    ...     torch.save(state, tmp)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_directory",
    "atomic_file",
    "fsync_dir",
    "readable_directory",
    "write_text_atomic",
]

_TMP_MARK = ".kolossos-tmp-"
_STAGING_SUFFIX = ".kolossos-staging"
_OLD_SUFFIX = ".kolossos-old"

# Test hook: each callable is called with the final path after a file was committed. The
# kill-during-save test uses it to stop a writer at a known point; library code never sets it.
_ON_FILE_COMMITTED: list[Callable[[Path], None]] = []


def fsync_dir(path: Path) -> None:
    """``fsync`` a directory so renames in it are durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is fsync-ed and renamed onto ``path``.

    The caller writes the temporary file completely (by path, e.g. ``torch.save(obj, tmp)``). If the
    block raises, the temporary file is removed and ``path`` is untouched.

    Args:
        path: the final file name. Its parent directory is created if needed.

    Example:
        >>> with atomic_file("ckpt/model.bin") as tmp:
        ...     torch.save(model.state_dict(), tmp)
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}{_TMP_MARK}*"):  # left by a killed writer
        stale.unlink(missing_ok=True)
    tmp = final.parent / f".{final.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)
    for hook in list(_ON_FILE_COMMITTED):
        hook(final)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _staging_path(target: Path) -> Path:
    return target.parent / f".{target.name}{_STAGING_SUFFIX}"


def _old_path(target: Path) -> Path:
    return target.parent / f".{target.name}{_OLD_SUFFIX}"


def readable_directory(target: str | os.PathLike[str]) -> Path | None:
    """Return where the directory checkpoint ``target`` can be read, or ``None`` if nowhere.

    Normally ``target`` itself; if a save without atomic exchange was interrupted between its two
    renames, the previous checkpoint still sits at ``.<name>.kolossos-old`` and that is returned.
    """
    path = Path(target)
    if path.exists():
        return path
    old = _old_path(path)
    return old if old.is_dir() else None


def _is_temporary(name: str) -> bool:
    return _TMP_MARK in name or name.endswith((_STAGING_SUFFIX, _OLD_SUFFIX))


def _link_or_copy(src: str, dst: str) -> Any:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _carry_over(old: Path, staging: Path, owned: Callable[[str], bool]) -> None:
    """Hard-link (or copy) the entries of ``old`` the new checkpoint neither owns nor rewrote."""
    for entry in old.iterdir():
        name = entry.name
        if owned(name) or _is_temporary(name) or (staging / name).exists():
            continue
        dest = staging / name
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dest)
        elif entry.is_dir():
            shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(dest))


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; ``False`` if the platform or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _install(staging: Path, target: Path) -> None:
    """Make ``staging`` the directory at ``target``; the old content is deleted afterwards."""
    if not target.exists():
        os.rename(staging, target)
        fsync_dir(target.parent)
        return
    if _exchange(staging, target):
        fsync_dir(target.parent)
        shutil.rmtree(staging, ignore_errors=True)  # now holds the previous checkpoint
        return
    old = _old_path(target)
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)  # from here to the next rename, readers use ``old``
    os.rename(staging, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _recover(target: Path) -> None:
    """Undo the traces of an interrupted earlier save before starting a new one."""
    old = _old_path(target)
    if old.is_dir():
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, target)
    shutil.rmtree(_staging_path(target), ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(
    target: str | os.PathLike[str], owned: Callable[[str], bool] = lambda name: True
) -> Iterator[Path]:
    """Yield a fresh staging directory; on success it replaces ``target`` in one atomic step.

    Write every file of the new checkpoint into the yielded directory, the index last. Entries of
    an existing ``target`` for which ``owned(name)`` is false are kept (hard-linked into the new
    directory). On an exception the staging directory is removed and ``target`` is untouched.

    Args:
        target: the checkpoint directory. Parents are created if needed; a symlink is followed.
        owned: which entry names belong to the checkpoint being replaced.

    Raises:
        NotADirectoryError: ``target`` exists and is not a directory.

    Example:
        >>> with atomic_directory("ckpt/model") as staging:
        ...     write_shards(staging); write_index(staging)
    """
    path = Path(os.path.realpath(target))
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"checkpoint path {str(target)!r} is a file, but a directory checkpoint was requested; "
            "pass a directory path (or save with shard=False)."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path)
    staging = _staging_path(path)
    staging.mkdir()
    try:
        yield staging
        fsync_dir(staging)
        if path.exists():
            _carry_over(path, staging, owned)
        _install(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
