"""Reading and writing one checkpoint file: safetensors or torch (``.bin``), with clear errors.

Every write goes through :func:`~kolossos.checkpoint_io.atomic.atomic_file`. Every read is safe:
safetensors never runs code, and torch files are read with ``torch.load(weights_only=True)``. The
format of an existing file is recognised from its first bytes, not its name, and any failure to
parse it becomes a :class:`~kolossos.checkpoint_io.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from kolossos.checkpoint_io.atomic import atomic_file
from kolossos.checkpoint_io.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "SAFETENSORS",
    "TORCH",
    "TensorInfo",
    "read_object_file",
    "read_tensor_file",
    "read_tensor_infos",
    "require_safetensors",
    "sniff_format",
    "write_object_file",
    "write_tensor_file",
]

SAFETENSORS = "safetensors"
TORCH = "torch"
TensorInfo = tuple[tuple[int, ...], str]  #: (shape, dtype name) of a stored tensor


def require_safetensors() -> Any:
    """Import and return ``safetensors.torch``, or raise ``ImportError`` with the install hint."""
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            "use_safetensors=True and .safetensors checkpoints need the 'safetensors' package: "
            "pip install kolossos[hf]  (or: pip install safetensors)"
        ) from exc
    return safetensors.torch


def sniff_format(path: str | os.PathLike[str]) -> str:
    """Return :data:`SAFETENSORS` or :data:`TORCH` from the first bytes of ``path``.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CheckpointError: the file is empty, truncated, or neither format.
    """
    file = Path(path)
    try:
        with open(file, "rb") as f:
            head = f.read(9)
        size = file.stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint file {str(file)!r} does not exist") from exc
    except IsADirectoryError as exc:
        raise CheckpointError(f"checkpoint file {str(file)!r} is a directory") from exc
    if not head:
        raise CheckpointError(f"checkpoint file {str(file)!r} is empty (truncated write?)")
    if len(head) == 9 and head[8:9] == b"{":  # u64 header length, then the JSON header
        (header_len,) = struct.unpack("<Q", head[:8])
        if 8 + header_len <= size:
            return SAFETENSORS
        if head[:4] != b"PK\x03\x04":
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is a truncated safetensors file: its header "
                f"claims {header_len} bytes but the file has {size}"
            )
    if head[:4] == b"PK\x03\x04" or head[:2] == b"\x80\x02":  # zip archive / legacy pickle
        return TORCH
    raise CheckpointError(
        f"checkpoint file {str(file)!r} is neither a safetensors nor a torch file "
        f"(first bytes {head[:8]!r}); it is corrupt or not a checkpoint"
    )


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns exactly its bytes (views of bigger storages are copied)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def write_tensor_file(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], fmt: str = TORCH
) -> None:
    """Write a flat ``name -> tensor`` mapping to ``path`` atomically, as ``fmt``.

    safetensors files carry the metadata ``{"format": "pt"}`` that Hugging Face expects.
    """
    plain = {name: _plain(t) for name, t in tensors.items()}
    with atomic_file(path) as tmp:
        if fmt == SAFETENSORS:
            require_safetensors().save_file(plain, str(tmp), metadata={"format": "pt"})
        else:
            torch.save(plain, tmp)


def _plain_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _plain(obj)
    if isinstance(obj, dict):
        return {k: _plain_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_tree(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_plain_tree(v) for v in obj)
    return obj


def write_object_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` a nested structure of tensors and plain data to ``path`` atomically.

    Tensors are saved as compact CPU tensors (views of larger storages are copied first).
    """
    plain = _plain_tree(obj)
    with atomic_file(path) as tmp:
        torch.save(plain, tmp)


def _torch_load(file: Path, mmap: bool) -> Any:
    try:
        if file.name.endswith(".safetensors"):  # torch.load would treat it as safetensors
            with open(file, "rb") as f:
                return torch.load(f, map_location="cpu", weights_only=True)
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        if mmap and "mmap" in str(exc):  # legacy (non-zip) torch file: cannot be memory-mapped
            return _torch_load(file, mmap=False)
        if isinstance(exc, FileNotFoundError):
            raise CheckpointNotFoundError(f"checkpoint file {str(file)!r} does not exist") from exc
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise CheckpointError(
                f"checkpoint file {str(file)!r} holds Python objects that safe loading refuses "
                f"(kolossos never runs code from a checkpoint): {exc}. Keep only tensors and plain "
                "data in saved state, or allow the type with torch.serialization.add_safe_globals."
            ) from exc
        raise CheckpointError(
            f"checkpoint file {str(file)!r} is corrupt or truncated and cannot be read: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def read_object_file(path: str | os.PathLike[str], mmap: bool = False) -> Any:
    """Load a torch file written by :func:`write_object_file` (or ``torch.save``) safely.

    Args:
        path: the file.
        mmap: memory-map tensor data instead of reading it (copy what you keep).
    """
    file = Path(path)
    if sniff_format(file) != TORCH:
        raise CheckpointError(f"checkpoint file {str(file)!r} is not a torch file")
    return _torch_load(file, mmap=mmap)


def safe_open_file(file: Path) -> Any:
    """``safetensors.safe_open`` of ``file`` (CPU tensors), with a clear error for a bad file."""
    st = require_safetensors()
    try:
        return st.safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {str(file)!r} is a corrupt or truncated safetensors file: {exc}"
        ) from exc


def read_tensor_infos(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Return ``name -> (shape, dtype)`` of every tensor in ``path`` without reading the data.

    For torch files the data is memory-mapped, not read.
    """
    file = Path(path)
    if sniff_format(file) == SAFETENSORS:
        with safe_open_file(file) as f:
            out: dict[str, TensorInfo] = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
            return out
    obj = _torch_load(file, mmap=True)
    _check_flat(obj, file)
    return {name: (tuple(t.shape), str(t.dtype)) for name, t in obj.items()}


def read_tensor_file(
    path: str | os.PathLike[str], names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Read tensors (all, or only ``names``) from a safetensors or torch file.

    Torch files are memory-mapped: their pages are read while the tensors are copied elsewhere and
    released when the returned dict is dropped.
    """
    file = Path(path)
    wanted = None if names is None else set(names)
    if sniff_format(file) == SAFETENSORS:
        with safe_open_file(file) as f:
            keys = [k for k in f.keys() if wanted is None or k in wanted]  # noqa: SIM118
            try:
                return {k: f.get_tensor(k) for k in keys}
            except Exception as exc:
                raise CheckpointError(f"checkpoint file {str(file)!r} is corrupt: {exc}") from exc
    obj = _torch_load(file, mmap=True)
    _check_flat(obj, file)
    return {k: v for k, v in obj.items() if wanted is None or k in wanted}


def _check_flat(obj: Any, file: Path) -> None:
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise CheckpointError(
            f"checkpoint file {str(file)!r} is not a flat name -> tensor state dict "
            f"(found {type(obj).__name__}); is it an optimizer or legacy checkpoint?"
        )


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON file, turning syntax errors into a :class:`CheckpointError` naming it."""
    file = Path(path)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint file {str(file)!r} does not exist") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint index {str(file)!r} is corrupt or truncated: {exc}"
        ) from exc
