"""File names, shard planning and the JSON index of a sharded checkpoint.

A sharded checkpoint is a directory of shard files plus one index (Hugging Face's layout)::

    model-00001-of-00003.safetensors  ...  model.safetensors.index.json
    {"metadata": {"total_size": <bytes>, ...}, "weight_map": {"<tensor name>": "<shard file>"}}

Shards are planned greedily in the order tensors arrive: a shard is closed when the next entry
would take it past the size limit, so every shard stays within the limit unless a single entry is
bigger than the limit (that entry then gets a shard of its own, as in Hugging Face).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from kolossos.checkpoint_io.atomic import fsync_dir, write_text_atomic
from kolossos.checkpoint_io.backends import read_json
from kolossos.checkpoint_io.errors import CheckpointError

__all__ = [
    "CONFIG_NAME",
    "OPTIM_GROUP_NAME",
    "OPTIM_INDEX_NAME",
    "OPTIM_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointIndex",
    "add_prefix",
    "iter_shards",
    "nbytes",
    "shard_file_name",
    "write_shards",
]

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
OPTIM_NAME = "pytorch_optim.bin"
OPTIM_INDEX_NAME = "pytorch_optim.bin.index.json"
OPTIM_GROUP_NAME = "pytorch_optim_group.bin"
CONFIG_NAME = "config.json"

T = TypeVar("T")


def add_prefix(name: str, prefix: str | None) -> str:
    """Prepend ``prefix`` and a dash to a file name (``None`` or ``""`` leave it unchanged).

    Example:
        >>> add_prefix("model.safetensors.index.json", "epoch3")
        'epoch3-model.safetensors.index.json'
    """
    if not prefix:
        return name
    if not isinstance(prefix, str) or "/" in prefix or os.sep in prefix or prefix in (".", ".."):
        raise ValueError(
            f"prefix={prefix!r} must be a plain string without path separators, e.g. 'epoch3'."
        )
    return f"{prefix}-{name}"


def shard_file_name(base: str, index: int, total: int) -> str:
    """Name of shard ``index`` (1-based) of ``total`` for a single-file name ``base``.

    Example:
        >>> shard_file_name("model.safetensors", 1, 3)
        'model-00001-of-00003.safetensors'
        >>> shard_file_name("pytorch_model.bin", 2, 3)
        'pytorch_model-00002-of-00003.bin'
    """
    stem, dot, ext = base.rpartition(".")
    return f"{stem}-{index:05d}-of-{total:05d}{dot}{ext}"


def shard_name_pattern(base: str) -> re.Pattern[str]:
    """A regular expression matching every shard name of ``base`` (any index and total)."""
    stem, dot, ext = base.rpartition(".")
    return re.compile(rf"^{re.escape(stem)}-\d{{5,}}-of-\d{{5,}}{re.escape(dot + ext)}$")


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or dicts/lists/tuples of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def iter_shards(
    items: Iterable[tuple[str, T]], max_bytes: int, size: Callable[[T], int] = nbytes
) -> Iterator[dict[str, T]]:
    """Group ``(name, value)`` pairs into consecutive shards of at most ``max_bytes`` each.

    Only one shard is held at a time: each is yielded as soon as it is full. An entry bigger than
    ``max_bytes`` forms a shard of its own.

    Example:
        >>> items = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(4))]
        >>> [list(s) for s in iter_shards(items, max_bytes=32)]
        [['a', 'b'], ['c']]
    """
    if max_bytes <= 0:
        raise ValueError(f"the shard size limit must be positive, got {max_bytes} bytes.")
    shard: dict[str, T] = {}
    used = 0
    for name, value in items:
        n = size(value)
        if shard and used + n > max_bytes:
            yield shard
            shard, used = {}, 0
        shard[name] = value
        used += n
    if shard:
        yield shard


@dataclass
class CheckpointIndex:
    """The index of a sharded checkpoint: which file holds each entry, plus metadata.

    Attributes:
        weight_map: entry name -> shard file name (relative to the index's directory).
        metadata: free-form JSON metadata; ``total_size`` (bytes) is always present.
        path: where the index was read from (``None`` for one being built).
    """

    weight_map: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def files(self) -> list[str]:
        """The shard files, each once, in name order."""
        return sorted(set(self.weight_map.values()))

    def names_in(self, file: str) -> list[str]:
        """The entries stored in shard ``file``."""
        return [name for name, f in self.weight_map.items() if f == file]

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the index as JSON atomically (do this after every shard is written)."""
        body = {"metadata": self.metadata, "weight_map": dict(sorted(self.weight_map.items()))}
        write_text_atomic(path, json.dumps(body, indent=2, sort_keys=False) + "\n")

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> CheckpointIndex:
        """Read and validate an index; shard files must exist next to it.

        Raises:
            CheckpointError: malformed JSON, a missing ``weight_map``, a file name that points
                outside the directory, or a missing shard file.
        """
        file = Path(path)
        body = read_json(file)
        weight_map = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"checkpoint index {str(file)!r} has no valid 'weight_map' (name -> file mapping)"
            )
        metadata = body.get("metadata") or {}
        index = cls(weight_map=dict(weight_map), metadata=dict(metadata), path=file)
        for shard in index.files():
            if Path(shard).name != shard or shard in (".", ".."):
                raise CheckpointError(
                    f"checkpoint index {str(file)!r} names {shard!r}, which is not a plain file "
                    "name in the index's directory"
                )
            if not (file.parent / shard).is_file():
                raise CheckpointError(
                    f"checkpoint index {str(file)!r} lists shard {shard!r}, but "
                    f"{str(file.parent / shard)!r} does not exist (incomplete copy?)"
                )
        return index


def write_shards(
    items: Iterable[tuple[str, T]],
    directory: Path,
    base: str,
    max_bytes: int,
    write: Callable[[dict[str, T], Path], None],
    size: Callable[[T], int] = nbytes,
) -> CheckpointIndex:
    """Write ``items`` as shards ``<base stem>-0000k-of-0000n.<ext>`` into ``directory``.

    Shards are written one at a time as they fill (so memory holds about one shard) under
    provisional names, and renamed once their count is known. The caller writes the index returned
    here *after* this function, which makes the directory complete.

    Args:
        items: ``(name, value)`` pairs in the order to store them.
        directory: a private staging directory (see ``atomic_directory``).
        base: the single-file name the shard names derive from, e.g. ``"model.safetensors"``.
        max_bytes: the shard size limit.
        write: writes one shard (a ``name -> value`` dict) to a path, atomically.
        size: bytes of one value.

    Returns:
        The index (``weight_map`` and ``metadata.total_size``), not yet written.
    """
    parts: list[tuple[str, list[str]]] = []
    total = 0
    for number, shard in enumerate(iter_shards(items, max_bytes, size), start=1):
        provisional = f".{base}.part{number:05d}"
        write(shard, directory / provisional)
        total += sum(size(v) for v in shard.values())
        parts.append((provisional, list(shard)))
        del shard  # keep one shard alive at a time, not two
    weight_map: dict[str, str] = {}
    for number, (provisional, names) in enumerate(parts, start=1):
        final = shard_file_name(base, number, len(parts))
        os.rename(directory / provisional, directory / final)
        weight_map.update(dict.fromkeys(names, final))
    fsync_dir(directory)
    return CheckpointIndex(weight_map=weight_map, metadata={"total_size": total})
