"""Saving and loading model state through a :class:`CheckpointIO`'s hooks.

``save_model`` layouts (``P`` = ``prefix-`` when a prefix is given):

* ``shard=False``, ``checkpoint`` a file path: one file, torch or safetensors;
* ``shard=False``, ``checkpoint`` an existing directory: ``P pytorch_model.bin`` or
  ``P model.safetensors`` inside it (Hugging Face's unsharded layout);
* ``shard=True``: a directory of ``size_per_shard``-MB shards and an index, Hugging Face's sharded
  layout, plus ``config.json`` for a ``transformers`` model (so ``from_pretrained`` loads it).

Directories are replaced atomically (``atomic_directory``); files with ``atomic_file``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from kolossos.checkpoint_io._common import check_save_args
from kolossos.checkpoint_io.atomic import atomic_directory, write_text_atomic
from kolossos.checkpoint_io.backends import (
    SAFETENSORS,
    TORCH,
    require_safetensors,
    write_tensor_file,
)
from kolossos.checkpoint_io.errors import LoadReport
from kolossos.checkpoint_io.index import CONFIG_NAME, write_shards
from kolossos.checkpoint_io.model_files import (
    find_model_checkpoint,
    model_file_names,
    owned_model_files,
)
from kolossos.checkpoint_io.state_check import compare_model_state, finish_report
from kolossos.interface import unwrap_model

if TYPE_CHECKING:
    from kolossos.checkpoint_io.checkpoint_io_base import CheckpointIO

__all__ = ["hf_config_json", "load_model", "save_model"]


def hf_config_json(model: nn.Module) -> str | None:
    """``config.json`` text for a ``transformers`` model (``None`` for other models)."""
    module = unwrap_model(model)
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    body = json.loads(to_json())
    body.setdefault("architectures", [type(module).__name__])
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def _write_model(
    items: Iterable[tuple[str, torch.Tensor]],
    path: Path,
    *,
    directory: bool,
    shard: bool,
    prefix: str | None,
    max_bytes: int,
    fmt: str,
    config: str | None,
    tied: set[str],
) -> None:
    """The writer rank's part of ``save_model``: files from the state items, each tied tensor once.

    ``tied`` names the entries saved under another name. They are found on the live model, not
    by the storage of the items: gathered items are temporaries whose freed memory a later item
    may reuse, which would make two unrelated tensors look tied.
    """
    unique = ((name, tensor) for name, tensor in items if name not in tied)
    if not directory:
        write_tensor_file(dict(unique), path, fmt)
        return
    single, index_name = model_file_names(prefix, fmt == SAFETENSORS)
    with atomic_directory(path, owned_model_files(prefix)) as staging:
        if config is not None and not prefix:
            write_text_atomic(staging / CONFIG_NAME, config)
        if not shard:
            write_tensor_file(dict(unique), staging / single, fmt)
            return
        numel = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in unique:
                numel[0] += tensor.numel()
                yield name, tensor

        index = write_shards(
            counted(), staging, single, max_bytes, lambda s, p: write_tensor_file(s, p, fmt)
        )
        index.metadata["total_parameters"] = numel[0]  # Hugging Face 5 records it too
        index.write(staging / index_name)  # last: the directory is complete from here on


def save_model(
    io: CheckpointIO,
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    shard: bool = False,
    gather_dtensor: bool = True,
    prefix: str | None = None,
    size_per_shard: float = 1024,
    use_safetensors: bool = False,
    use_async: bool = False,
) -> None:
    """Save ``model``'s full state through ``io``'s hooks (see the module docstring).

    Args:
        io: supplies the state (``model_state_items``) and the writer rank.
        model: the model (boosted or not).
        checkpoint: a file path (``shard=False``) or a directory path.
        shard: write a directory of shards plus an index.
        gather_dtensor: gather distributed tensors into full ones (passed to the hook).
        prefix: prepended (with a dash) to the file names in a directory; ``None``/``""``: none.
        size_per_shard: shard size limit in MB (MiB).
        use_safetensors: write ``.safetensors`` instead of torch files.
        use_async: return once the state is in host memory; the writer rank writes the files in
            the background (``io.wait_async()`` waits for them).

    Raises:
        TypeError, ValueError: bad arguments (before anything is written).
        NotADirectoryError: ``shard=True`` and ``checkpoint`` is an existing file.
    """
    max_bytes = check_save_args(checkpoint, size_per_shard, prefix)
    if use_safetensors:
        require_safetensors()
    path = Path(checkpoint)
    if shard and path.is_file():
        raise NotADirectoryError(
            f"checkpoint={str(path)!r} is a file but shard=True writes a directory; pass a "
            "directory path or use shard=False."
        )
    if not use_safetensors and not shard and path.name.endswith(".safetensors"):
        raise ValueError(
            f"checkpoint={str(path)!r} is named .safetensors but use_safetensors=False would "
            "write a torch file; pass use_safetensors=True or another file name."
        )
    config = hf_config_json(model)
    fmt = SAFETENSORS if use_safetensors else TORCH

    tied = set(io.model_layout(model).aliases)

    directory = shard or path.is_dir()

    def write(items: Iterator[tuple[str, torch.Tensor]]) -> None:
        _write_model(
            items,
            path,
            directory=directory,
            shard=shard,
            prefix=prefix,
            max_bytes=max_bytes,
            fmt=fmt,
            config=config,
            tied=tied,
        )

    io.collective_save(lambda: io.model_state_items(model, gather_dtensor), write, path, use_async)


def load_model(
    io: CheckpointIO, model: nn.Module, checkpoint: str | os.PathLike[str], strict: bool = True
) -> LoadReport:
    """Load the model checkpoint at ``checkpoint`` into ``model`` through ``io``'s hooks.

    The layout and format are detected. Names and shapes are checked against the model (from
    the files' headers) before anything is loaded; then the files are read one at a time.

    Args:
        io: supplies the model's expected layout and how a piece of state is loaded.
        model: the model (boosted or not).
        checkpoint: a file, an index file or a directory.
        strict: raise if anything is missing, unexpected or wrongly shaped; otherwise load what
            matches and report the rest.

    Returns:
        The :class:`LoadReport` of what was not loaded (empty after a strict load).

    Raises:
        CheckpointMismatchError: ``strict`` and the checkpoint does not match; nothing loaded.
        CheckpointError: a missing, corrupt or truncated file (named in the message).
    """
    source = find_model_checkpoint(checkpoint)
    found = source.infos()
    report, wanted = compare_model_state(io.model_layout(model), found)
    finish_report(report, "model", source.path, strict)
    for piece in source.iter_pieces(wanted, io.model_read_plan(model)):
        io.load_model_piece(model, piece)
        del piece
    return report
