"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shards, no rank gathers a full tensor, and loading reshards to any world size or layout.

A DCP checkpoint is a directory holding DCP's ``.metadata`` (which is how loaders recognise it)
and one ``__<rank>_<n>.distcp`` file per writing rank, plus our ``kolossos_dcp.json`` marker
saying whether it holds a model or an optimizer. A model's entries are its state-dict names. An
optimizer's tensors are stored as ``state/<param name>/<key>``, next to a header
(``kolossos_optim_header.bin``, read with ``weights_only=True``) carrying the name-keyed format's
``param_groups`` and shapes, the dtype and shape of every state tensor, and non-tensor state.

Writes are crash-safe like every kolossos checkpoint: all ranks write into a staging directory
that the writer rank swaps in once DCP has written ``.metadata`` (after every rank's files).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.checkpoint_io import CheckpointError, CheckpointIO, LoadReport
from kolossos.checkpoint_io.atomic import atomic_directory, readable_directory, write_text_atomic
from kolossos.checkpoint_io.model_files import owned_model_files
from kolossos.checkpoint_io.optim_files import owned_optimizer_files
from kolossos.checkpoint_io.state_check import compare_model_state, finish_report
from kolossos.interface import unwrap_model

__all__ = [
    "DCP_FORMAT",
    "DCP_MARKER",
    "DCP_METADATA",
    "dcp_kind",
    "find_dcp_directory",
    "load_model_dcp",
    "run_dcp",
    "save_dcp",
    "save_model_dcp",
]

DCP_METADATA = ".metadata"
DCP_MARKER = "kolossos_dcp.json"
DCP_FORMAT = "kolossos.dcp"
_OWN_NAMES = {DCP_METADATA, DCP_MARKER, "kolossos_optim_header.bin"}


def _dcp_owned(other: Callable[[str], bool]) -> Callable[[str], bool]:
    return lambda name: name in _OWN_NAMES or name.endswith(".distcp") or other(name)


def find_dcp_directory(checkpoint: str | os.PathLike[str]) -> Path | None:
    """The readable DCP directory at ``checkpoint`` (``None`` if it is not one)."""
    directory = readable_directory(checkpoint)
    if directory is None or not directory.is_dir() or not (directory / DCP_METADATA).is_file():
        return None
    return directory


def dcp_kind(directory: Path) -> str | None:
    """``'model'`` or ``'optimizer'`` from the marker (``None`` for a foreign DCP directory)."""
    marker = directory / DCP_MARKER
    if not marker.is_file():
        return None
    try:
        body = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(marker)!r} is not a valid kolossos DCP marker: {exc}") from exc
    kind = body.get("kind") if isinstance(body, dict) else None
    return kind if isinstance(kind, str) else None


def _distributed(io: CheckpointIO) -> bool:
    initialized = dist.is_available() and dist.is_initialized()
    return initialized and dist.get_world_size(io.process_group) > 1


def run_dcp(fn: Callable[..., Any], state: dict[str, Any], path: Path, io: CheckpointIO) -> None:
    """``dcp.save`` / ``dcp.load`` over ``io``'s group, or in this process alone when
    torch.distributed is not initialised (without DCP's warning that it assumes so)."""
    if dist.is_available() and dist.is_initialized():
        fn(state, checkpoint_id=path, process_group=io.process_group)  # collective
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        fn(state, checkpoint_id=path, no_dist=True)


def _writer_rank(io: CheckpointIO) -> int:
    return dist.get_global_rank(io.process_group, 0) if io.process_group is not None else 0


def save_dcp(
    io: CheckpointIO,
    state: dict[str, Any],
    checkpoint: str | os.PathLike[str],
    kind: str,
    extra_files: Callable[[Path], None] | None = None,
) -> None:
    """Write ``state`` as a DCP directory at ``checkpoint`` (collective, crash-safe).

    Args:
        io: decides the writer rank and the process group (``io.process_group``).
        state: a flat ``{name: tensor or DTensor}`` dict; each rank passes its own shards.
        checkpoint: the directory to (re)place.
        kind: ``'model'`` or ``'optimizer'`` (recorded in the marker).
        extra_files: the writer rank calls it with the staging directory to add files.

    Raises:
        ValueError: the directory holds a DCP checkpoint of the other kind (they cannot share a
            directory: both need ``.metadata``).
    """
    import torch.distributed.checkpoint as dcp

    path = Path(checkpoint)
    existing = find_dcp_directory(path)
    if existing is not None and dcp_kind(existing) not in (None, kind):
        raise ValueError(
            f"{str(path)!r} holds a DCP {dcp_kind(existing)} checkpoint; save the {kind} into "
            "another directory (DCP model and optimizer checkpoints cannot share one)."
        )
    other = owned_model_files(None) if kind == "model" else owned_optimizer_files(None)
    distributed = _distributed(io)

    def write() -> None:
        with contextlib.ExitStack() as stack:
            box: list[Any] = [None, None]
            if io.is_writer():
                try:
                    box[0] = str(stack.enter_context(atomic_directory(path, _dcp_owned(other))))
                except Exception as exc:
                    box[1] = f"{type(exc).__name__}: {exc}"
                    if not distributed:
                        raise
            if distributed:  # sync point: every rank learns where to write
                dist.broadcast_object_list(box, src=_writer_rank(io), group=io.process_group)
            if box[0] is None:
                raise CheckpointError(f"saving {str(path)!r}: the writer rank failed: {box[1]}")
            staging = Path(box[0])
            run_dcp(dcp.save, state, staging, io)  # collective
            if io.is_writer():
                if extra_files is not None:
                    extra_files(staging)
                marker = {"format": DCP_FORMAT, "version": 1, "kind": kind}
                write_text_atomic(staging / DCP_MARKER, json.dumps(marker) + "\n")

    io.run_collective_write(write, path)


def _reshard(model: nn.Module) -> None:
    """Bring FSDP2 modules back to sharded parameters (they may hold gathered ones after an
    evaluation forward), so the state dict holds the ``DTensor`` shards."""
    for module in model.modules():
        reshard = getattr(module, "reshard", None)
        if callable(reshard) and hasattr(module, "unshard"):
            reshard()


def save_model_dcp(io: CheckpointIO, model: nn.Module, checkpoint: str | os.PathLike[str]) -> None:
    """Save ``model``'s state dict (shards as they are) as a DCP directory (collective)."""
    module = unwrap_model(model)
    _reshard(module)
    save_dcp(io, dict(module.state_dict()), checkpoint, "model")


def _found_tensors(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # DCP raises assorted errors on a damaged file
        raise CheckpointError(f"cannot read DCP metadata in {str(directory)!r}: {exc}") from exc
    return {
        name: (tuple(entry.size), str(entry.properties.dtype).removeprefix("torch."))
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def load_model_dcp(
    io: CheckpointIO, model: nn.Module, directory: Path, strict: bool = True
) -> LoadReport:
    """Load a DCP model checkpoint into ``model`` (any world size, sharded or not).

    Names and global shapes are checked first (as for every model checkpoint); then every rank
    reads only the pieces of its own shards.

    Raises:
        CheckpointMismatchError: ``strict`` and names or shapes differ; nothing is loaded.
        CheckpointError: the directory holds an optimizer checkpoint, or is damaged.
    """
    import torch.distributed.checkpoint as dcp

    if dcp_kind(directory) not in (None, "model"):
        raise CheckpointError(f"{str(directory)!r} is a DCP {dcp_kind(directory)} checkpoint.")
    module = unwrap_model(model)
    _reshard(module)
    report, wanted = compare_model_state(io.model_layout(model), _found_tensors(directory))
    finish_report(report, "model", directory, strict)
    target = module.state_dict()
    template = {name: target[name] for name in wanted}
    run_dcp(dcp.load, template, directory, io)  # collective
    with torch.no_grad():  # DCP fills the tensors in place; this also runs load hooks
        module.load_state_dict(template, strict=False)
    return report
