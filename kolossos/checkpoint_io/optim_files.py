"""Optimizer checkpoints on disk: one file, or a directory of shards with an index.

Layouts (``P`` is the optional ``prefix-``):

* one file at any path: ``torch.save`` of ``{**header, "state": {name: state}}``;
* a directory: shards ``P pytorch_optim-0000k-of-0000n.bin`` (each ``{name: state}``), the header
  in ``P pytorch_optim_group.bin``, and last the index ``P pytorch_optim.bin.index.json``:
  ``{"metadata": {"total_size", "format", "version", "param_groups": <group file>},
  "weight_map": {name: shard}}``.

The header and state formats are described in :mod:`kolossos.checkpoint_io.optim_format`.
A plain ``torch.optim`` ``state_dict()`` file is recognised too and loaded positionally.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kolossos.checkpoint_io.atomic import readable_directory
from kolossos.checkpoint_io.backends import read_object_file, write_object_file
from kolossos.checkpoint_io.errors import CheckpointError, CheckpointNotFoundError
from kolossos.checkpoint_io.index import (
    OPTIM_GROUP_NAME,
    OPTIM_INDEX_NAME,
    OPTIM_NAME,
    CheckpointIndex,
    add_prefix,
    shard_name_pattern,
    write_shards,
)
from kolossos.checkpoint_io.optim_format import OPTIM_FORMAT, OPTIM_FORMAT_VERSION, check_header

__all__ = [
    "OptimizerSource",
    "find_optimizer_checkpoint",
    "owned_optimizer_files",
    "save_optimizer_sharded",
]

State = dict[str, Any]


def owned_optimizer_files(prefix: str | None) -> Callable[[str], bool]:
    """Whether a directory entry belongs to the optimizer checkpoint with ``prefix``."""
    exact = {add_prefix(n, prefix) for n in (OPTIM_NAME, OPTIM_INDEX_NAME, OPTIM_GROUP_NAME)}
    pattern = shard_name_pattern(add_prefix(OPTIM_NAME, prefix))
    return lambda name: name in exact or bool(pattern.match(name))


def save_optimizer_sharded(
    header: dict[str, Any],
    states: Iterable[tuple[str, State]],
    directory: Path,
    prefix: str | None,
    max_bytes: int,
) -> None:
    """Write shards, then the group file, then the index (last) into a staging ``directory``."""
    index = write_shards(
        states, directory, add_prefix(OPTIM_NAME, prefix), max_bytes, write_object_file
    )
    group_file = add_prefix(OPTIM_GROUP_NAME, prefix)
    write_object_file(header, directory / group_file)
    index.metadata.update(
        format=OPTIM_FORMAT, version=OPTIM_FORMAT_VERSION, param_groups=group_file
    )
    index.write(directory / add_prefix(OPTIM_INDEX_NAME, prefix))


@dataclass
class OptimizerSource:
    """A located optimizer checkpoint.

    Attributes:
        path: the single file or the index file.
        index: the parsed index (``None`` for a single file).
    """

    path: Path
    index: CheckpointIndex | None = None
    _single: Any = field(default=None, repr=False)

    def _load_single(self) -> Any:
        if self._single is None:
            self._single = read_object_file(self.path, mmap=True)
            if not isinstance(self._single, dict):
                raise CheckpointError(
                    f"{str(self.path)!r} is not an optimizer checkpoint "
                    f"(found {type(self._single).__name__})"
                )
        return self._single

    def is_torch_state_dict(self) -> bool:
        """Whether this is a plain positional ``torch.optim`` state dict."""
        if self.index is not None:
            return False
        obj = self._load_single()
        return "format" not in obj and {"state", "param_groups"} <= set(obj)

    def torch_state_dict(self) -> dict[str, Any]:
        """The plain ``torch.optim`` state dict (see :meth:`is_torch_state_dict`)."""
        return dict(self._load_single())

    def header(self) -> dict[str, Any]:
        """The validated header (format, version, named param groups, parameter shapes)."""
        if self.index is None:
            obj = self._load_single()
            header = check_header({k: v for k, v in obj.items() if k != "state"}, str(self.path))
            if not isinstance(obj.get("state"), dict):
                raise CheckpointError(f"optimizer checkpoint {str(self.path)!r} has no 'state'")
            return header
        group = self.index.metadata.get("param_groups", OPTIM_GROUP_NAME)
        file = self.path.parent / str(group)
        if Path(str(group)).name != group or not file.is_file():
            raise CheckpointError(
                f"optimizer index {str(self.path)!r} refers to param-group file {group!r}, "
                "which is missing"
            )
        return check_header(read_object_file(file), str(file))

    def iter_states(self) -> Iterator[tuple[str, State]]:
        """Yield ``(name, state)`` per parameter, one shard in memory at a time (memory-mapped)."""
        if self.index is None:
            yield from self._load_single()["state"].items()
            return
        for shard in self.index.files():
            file = self.path.parent / shard
            data = read_object_file(file, mmap=True)
            listed = self.index.names_in(shard)
            if not isinstance(data, dict) or any(n not in data for n in listed):
                raise CheckpointError(
                    f"optimizer shard {str(file)!r} lacks entries its index {str(self.path)!r} "
                    "lists; the checkpoint is corrupt"
                )
            for name in listed:
                yield name, data[name]
            del data


def _candidates(directory: Path, base: str) -> list[Path]:
    pattern = re.compile(rf"^(.+-)?{re.escape(base)}$")
    return sorted(p for p in directory.iterdir() if pattern.match(p.name) and p.is_file())


def find_optimizer_checkpoint(checkpoint: str | os.PathLike[str]) -> OptimizerSource:
    """Locate the optimizer checkpoint at ``checkpoint`` (a file, an index or a directory).

    Raises:
        CheckpointNotFoundError: nothing is there.
        CheckpointError: the directory holds several optimizer checkpoints, or the index is bad.
    """
    path = Path(checkpoint)
    if path.is_file():
        if path.name.endswith(".json"):
            return OptimizerSource(path, CheckpointIndex.read(path))
        return OptimizerSource(path)
    directory = readable_directory(path)
    if directory is None:
        raise CheckpointNotFoundError(f"optimizer checkpoint {str(path)!r} does not exist")
    if (directory / OPTIM_INDEX_NAME).is_file():
        return OptimizerSource(
            directory / OPTIM_INDEX_NAME, CheckpointIndex.read(directory / OPTIM_INDEX_NAME)
        )
    if (directory / OPTIM_NAME).is_file():
        return OptimizerSource(directory / OPTIM_NAME)
    indexes = _candidates(directory, OPTIM_INDEX_NAME)
    singles = _candidates(directory, OPTIM_NAME)
    found = indexes or singles
    if len(found) == 1:
        return OptimizerSource(found[0], CheckpointIndex.read(found[0]) if indexes else None)
    if not found:
        raise CheckpointNotFoundError(
            f"no optimizer checkpoint in directory {str(directory)!r}: expected "
            f"{OPTIM_INDEX_NAME} or {OPTIM_NAME} (optionally with a 'prefix-')"
        )
    raise CheckpointError(
        f"directory {str(directory)!r} holds several optimizer checkpoints "
        f"({', '.join(p.name for p in found)}); pass the path of the one to load"
    )
