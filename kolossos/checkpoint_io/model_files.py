"""Model checkpoints on disk: Hugging Face file names, format detection, reading piece by piece.

Layouts (``P`` is the optional ``prefix-``):

* one file at any path (safetensors or torch, recognised by content);
* a directory with ``P model.safetensors`` or ``P pytorch_model.bin`` (Hugging Face, unsharded);
* a directory with shards ``P model-0000k-of-0000n.safetensors`` and
  ``P model.safetensors.index.json``, or ``P pytorch_model-0000k-of-0000n.bin`` and
  ``P pytorch_model.bin.index.json``;
* the index file itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kolossos.checkpoint_io.atomic import readable_directory
from kolossos.checkpoint_io.backends import TensorInfo, read_tensor_infos
from kolossos.checkpoint_io.errors import CheckpointError, CheckpointNotFoundError
from kolossos.checkpoint_io.index import (
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointIndex,
    add_prefix,
    shard_name_pattern,
)
from kolossos.checkpoint_io.read_plan import ReadPlan, read_selected

__all__ = ["ModelSource", "find_model_checkpoint", "model_file_names", "owned_model_files"]

_INDEX_NAMES = (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME)  # safetensors wins, as in HF
_SINGLE_NAMES = (SAFE_WEIGHTS_NAME, WEIGHTS_NAME)


def model_file_names(prefix: str | None, use_safetensors: bool) -> tuple[str, str]:
    """``(single-file name, index name)`` for a model checkpoint with this prefix and format."""
    if use_safetensors:
        return add_prefix(SAFE_WEIGHTS_NAME, prefix), add_prefix(SAFE_WEIGHTS_INDEX_NAME, prefix)
    return add_prefix(WEIGHTS_NAME, prefix), add_prefix(WEIGHTS_INDEX_NAME, prefix)


def owned_model_files(prefix: str | None) -> Callable[[str], bool]:
    """Whether a directory entry belongs to the model checkpoint with ``prefix`` (either format).

    Saving a model replaces all of these (and ``config.json`` when there is no prefix), so a stale
    index of the other format cannot shadow the new checkpoint; other files in the directory are
    kept.
    """
    exact = {add_prefix(n, prefix) for n in (*_INDEX_NAMES, *_SINGLE_NAMES)}
    if not prefix:  # a new unprefixed save writes its own config.json, or none for non-HF models
        exact.add(CONFIG_NAME)
    patterns = [shard_name_pattern(add_prefix(n, prefix)) for n in _SINGLE_NAMES]
    return lambda name: name in exact or any(p.match(name) for p in patterns)


@dataclass(frozen=True)
class ModelSource:
    """A located model checkpoint: a single tensor file, or an index of shards.

    Attributes:
        path: the tensor file or the index file.
        index: the parsed index (``None`` for a single file).
    """

    path: Path
    index: CheckpointIndex | None = None

    def files(self) -> list[Path]:
        """Every tensor file of the checkpoint."""
        if self.index is None:
            return [self.path]
        return [self.path.parent / f for f in self.index.files()]

    def infos(self) -> dict[str, TensorInfo]:
        """``name -> (shape, dtype)`` of every stored tensor, from the file headers only.

        Raises:
            CheckpointError: a file is unreadable, or a shard lacks entries its index promises.
        """
        out: dict[str, TensorInfo] = {}
        for file in self.files():
            infos = read_tensor_infos(file)
            if self.index is not None:
                listed = self.index.names_in(file.name)
                absent = [n for n in listed if n not in infos]
                if absent:
                    raise CheckpointError(
                        f"shard {str(file)!r} lacks {len(absent)} tensors its index "
                        f"{str(self.path)!r} lists (e.g. {absent[0]!r}); the checkpoint is corrupt"
                    )
                infos = {n: infos[n] for n in listed}
            out.update(infos)
        return out

    def iter_pieces(
        self, names: Iterable[str], plan: ReadPlan | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield the wanted tensors file by file (one file's worth in memory at a time), read
        as ``plan`` selects (:mod:`~kolossos.checkpoint_io.read_plan`); a file of which the plan
        wants nothing is not opened."""
        wanted = set(names)
        if plan:
            wanted -= {n for n, selector in plan.items() if selector is None}
        for file in self.files():
            if self.index is not None:
                in_file = [n for n in self.index.names_in(file.name) if n in wanted]
                if not in_file:
                    continue
                yield read_selected(file, in_file, plan)
            else:
                yield read_selected(file, wanted, plan)


def _prefixed(directory: Path, base: str) -> list[Path]:
    pattern = re.compile(rf"^.+-{re.escape(base)}$")
    return sorted(p for p in directory.iterdir() if pattern.match(p.name) and p.is_file())


def _find_in_directory(directory: Path) -> ModelSource:
    for name in _INDEX_NAMES:
        if (directory / name).is_file():
            return ModelSource(directory / name, CheckpointIndex.read(directory / name))
    for name in _SINGLE_NAMES:
        if (directory / name).is_file():
            return ModelSource(directory / name)
    candidates = [p for base in _INDEX_NAMES for p in _prefixed(directory, base)]
    if not candidates:
        candidates = [p for base in _SINGLE_NAMES for p in _prefixed(directory, base)]
        if len(candidates) == 1:
            return ModelSource(candidates[0])
    elif len(candidates) == 1:
        return ModelSource(candidates[0], CheckpointIndex.read(candidates[0]))
    if not candidates:
        raise CheckpointNotFoundError(
            f"no model checkpoint in directory {str(directory)!r}: expected "
            f"{' or '.join(_INDEX_NAMES + _SINGLE_NAMES)} (optionally with a 'prefix-')"
        )
    raise CheckpointError(
        f"directory {str(directory)!r} holds several model checkpoints "
        f"({', '.join(p.name for p in candidates)}); pass the path of the one to load"
    )


def find_model_checkpoint(checkpoint: str | os.PathLike[str]) -> ModelSource:
    """Locate the model checkpoint at ``checkpoint`` (a file, an index, or a directory).

    Raises:
        CheckpointNotFoundError: nothing is there.
        CheckpointError: the index is malformed or names missing shards, or the directory holds
            several checkpoints.
    """
    path = Path(checkpoint)
    if path.is_file():
        if path.name.endswith(".json"):
            return ModelSource(path, CheckpointIndex.read(path))
        return ModelSource(path)
    directory = readable_directory(path)
    if directory is None:
        raise CheckpointNotFoundError(f"model checkpoint {str(path)!r} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"model checkpoint {str(path)!r} is neither a file nor a directory")
    return _find_in_directory(directory)
