"""CIFAR-10 "python version" files: find them, download them, and read them without trusting pickle.

The official batch files are pickles (written by Python 2). They are read with an unpickler that can
only rebuild dicts, lists, strings, numbers and numpy arrays, so a tampered file cannot run code.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tarfile
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

__all__ = ["UnsafePickleError", "download_cifar10", "find_cifar10", "load_cifar10_batch"]

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
BATCH_DIR = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"

_ALLOWED = {  # module -> names that may be loaded; numpy 2 renamed numpy.core to numpy._core
    "_codecs": {"encode"},  # how protocol-2 pickles written by Python 3 store bytes
    "numpy": {"ndarray", "dtype"},
    **{f"numpy.{core}.multiarray": {"_reconstruct", "scalar"} for core in ("core", "_core")},
    **{f"numpy.{core}.numeric": {"_frombuffer"} for core in ("core", "_core")},
}


class UnsafePickleError(pickle.UnpicklingError):
    """A batch file asked to load something other than containers and numpy arrays."""


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` restricted to what pickle emits for bytes: str to latin-1 bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"refusing _codecs.encode of {type(text).__name__} to {encoding!r}")
    return text.encode("latin-1")


def _rebuilders() -> dict[str, Any]:
    """numpy's own array/scalar rebuild functions, found without importing private modules."""
    return {
        "encode": _latin1_encode,
        "_reconstruct": np.ndarray(0).__reduce__()[0],
        "_frombuffer": np.zeros(1).__reduce_ex__(5)[0],
        "scalar": np.uint8(0).__reduce__()[0],
        "ndarray": np.ndarray,
        "dtype": np.dtype,
    }


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, path: Path) -> None:
        super().__init__(file, encoding="latin1")  # how numpy arrays from Python 2 must be read
        self._path = path
        self._rebuilders = _rebuilders()

    def find_class(self, module: str, name: str) -> Any:
        if name not in _ALLOWED.get(module, ()):
            raise UnsafePickleError(
                f"refusing to load '{module}.{name}' from {self._path}: a CIFAR-10 batch file "
                "holds only dicts, lists and numpy arrays, so this file is corrupted or malicious. "
                "Delete it and fetch the dataset again from the official source."
            )
        return self._rebuilders[name]


def load_cifar10_batch(path: str | os.PathLike[str]) -> tuple[torch.Tensor, list[int]]:
    """Read one batch file safely: images ``(N, 3, 32, 32)`` uint8 and their labels.

    Args:
        path: a ``data_batch_<k>`` or ``test_batch`` file.

    Returns:
        The images as a uint8 tensor and the labels (ints in ``[0, 10)``).

    Raises:
        UnsafePickleError: the file references anything but containers and numpy arrays.
        ValueError: the file is a valid pickle but not a CIFAR-10 batch.

    Example:
        >>> images, labels = load_cifar10_batch("cifar-10-batches-py/test_batch")  # doctest: +SKIP
        >>> images.shape, len(labels)  # doctest: +SKIP
        (torch.Size([10000, 3, 32, 32]), 10000)
    """
    path = Path(path)
    with path.open("rb") as f:
        entry = _RestrictedUnpickler(f, path).load()
    if not isinstance(entry, dict):
        raise ValueError(f"{path} holds a {type(entry).__name__}, not a CIFAR-10 batch dict.")
    entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}
    data, labels = entry.get("data"), entry.get("labels")
    shape = getattr(data, "shape", None)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or shape != (len(data), 3072):
        raise ValueError(f"{path}: 'data' must be an (N, 3072) uint8 array, got {shape}.")
    if not isinstance(labels, list) or len(labels) != len(data):
        raise ValueError(f"{path}: 'labels' must be a list of {len(data)} ints.")
    labels = [int(v) for v in labels]
    if any(not 0 <= v < len(CLASSES) for v in labels):
        raise ValueError(f"{path}: labels must lie in [0, {len(CLASSES)}).")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), labels


def find_cifar10(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The directory holding all six batch files, or None.

    ``<root>/cifar-10-batches-py`` and ``<root>`` itself are tried; ``root=None`` reads the
    ``DATA`` environment variable.

    Example:
        >>> find_cifar10("/nonexistent") is None
        True
    """
    base = root if root is not None else os.environ.get("DATA")
    if base is None:
        return None
    for candidate in (Path(base) / BATCH_DIR, Path(base)):
        if all((candidate / name).is_file() for name in (*TRAIN_FILES, *TEST_FILES)):
            return candidate
    return None


def download_cifar10(
    root: str | os.PathLike[str], *, url: str = URL, md5: str | None = MD5, timeout: float = 60.0
) -> Path:
    """Download the official archive into ``root`` and unpack it; returns the batch directory.

    Every file is written under a temporary name and renamed once complete (the archive only after
    its MD5 matched), so an interrupted run never leaves a truncated file behind. Only regular files
    directly inside ``cifar-10-batches-py/`` are extracted: no links, no paths escaping ``root``.

    Args:
        root: directory to download into (created if needed).
        url: where to fetch the archive from.
        md5: expected checksum of the archive; ``None`` skips the check.
        timeout: seconds to wait for the server.

    Raises:
        OSError: the download failed (``urllib.error.URLError`` is an ``OSError``).
        ValueError: the archive's checksum does not match.

    Example:
        >>> download_cifar10("./data")  # doctest: +SKIP
        PosixPath('data/cifar-10-batches-py')
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    archive = root / URL.rsplit("/", 1)[-1]
    if not archive.is_file():
        partial = archive.with_name(f"{archive.name}.part{os.getpid()}")
        digest = hashlib.md5(usedforsecurity=False)
        with urllib.request.urlopen(url, timeout=timeout) as response, partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if md5 is not None and digest.hexdigest() != md5:
            partial.unlink()
            raise ValueError(f"{url} has MD5 {digest.hexdigest()}, expected {md5}: corrupt.")
        os.replace(partial, archive)
    target = root / BATCH_DIR
    target.mkdir(exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) != 2 or parts[0] != BATCH_DIR or ".." in parts:
                continue
            source = tar.extractfile(member)
            assert source is not None  # a regular file always has a payload
            partial = target / f"{parts[1]}.part{os.getpid()}"
            with source, partial.open("wb") as out:
                shutil.copyfileobj(source, out)
            os.replace(partial, target / parts[1])
    return target
