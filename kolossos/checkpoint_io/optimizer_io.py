"""Saving and loading optimizer state by parameter name through a :class:`CheckpointIO`'s hooks.

``save_optimizer`` layouts (``P`` = ``prefix-`` when a prefix is given):

* ``shard=False``, ``checkpoint`` a file path: one torch file (header + state);
* ``shard=False``, ``checkpoint`` an existing directory: ``P pytorch_optim.bin`` inside it;
* ``shard=True``: a directory with ``P pytorch_optim-0000k-of-0000n.bin`` shards,
  ``P pytorch_optim_group.bin`` and, written last, ``P pytorch_optim.bin.index.json``.

See :mod:`kolossos.checkpoint_io.optim_format` for what the files contain.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kolossos.checkpoint_io._common import check_save_args
from kolossos.checkpoint_io.atomic import atomic_directory
from kolossos.checkpoint_io.backends import write_object_file
from kolossos.checkpoint_io.errors import LoadReport
from kolossos.checkpoint_io.index import OPTIM_NAME, add_prefix
from kolossos.checkpoint_io.optim_files import (
    find_optimizer_checkpoint,
    owned_optimizer_files,
    save_optimizer_sharded,
)
from kolossos.checkpoint_io.optim_format import build_header, match_optimizer
from kolossos.checkpoint_io.param_names import is_positional_name, unwrap_optimizer
from kolossos.checkpoint_io.state_check import finish_report
from kolossos.interface import LossScaler, OptimizerWrapper

if TYPE_CHECKING:
    from kolossos.checkpoint_io.checkpoint_io_base import CheckpointIO, OptimizerLike

__all__ = ["load_optimizer", "save_optimizer"]

_log = logging.getLogger("kolossos.checkpoint_io")

_POSITIONAL_WARNING = (
    "the optimizer's parameters have no names (it was not boosted, and register_param_names was "
    "not called), so its checkpoint is keyed by position (param_groups[i].params[j]); it will only "
    "load into an optimizer with the same param groups in the same order. Call "
    "kolossos.checkpoint_io.register_param_names(optimizer, model) to key it by name."
)


def _warn_if_positional(names: list[list[str]]) -> None:
    if any(is_positional_name(n) for group in names for n in group):
        _log.warning(_POSITIONAL_WARNING)


def save_optimizer(
    io: CheckpointIO,
    optimizer: OptimizerLike,
    checkpoint: str | os.PathLike[str],
    shard: bool = False,
    gather_dtensor: bool = True,
    prefix: str | None = None,
    size_per_shard: float = 1024,
    use_async: bool = False,
) -> None:
    """Save ``optimizer``'s full state keyed by parameter name (see the module docstring).

    Args:
        io: supplies names, shapes and states (its hooks) and the writer rank.
        optimizer: the optimizer (boosted or not).
        checkpoint: a file path (``shard=False``) or a directory path.
        shard: write a directory of shards plus an index.
        gather_dtensor: gather distributed tensors into full ones (passed to the hooks).
        prefix: prepended (with a dash) to the file names in a directory.
        size_per_shard: shard size limit in MB (MiB); one parameter's state is never split.
        use_async: return once the state is in host memory; the writer rank writes the files in
            the background (``io.wait_async()`` waits for them).

    Raises:
        TypeError, ValueError: bad arguments (before anything is written).
        NotADirectoryError: ``shard=True`` and ``checkpoint`` is an existing file.
    """
    max_bytes = check_save_args(checkpoint, size_per_shard, prefix)
    path = Path(checkpoint)
    if shard and path.is_file():
        raise NotADirectoryError(
            f"checkpoint={str(path)!r} is a file but shard=True writes a directory; pass a "
            "directory path or use shard=False."
        )
    names = io.optimizer_param_names(optimizer)
    if io.is_writer():
        _warn_if_positional(names)
    header = build_header(
        io.optimizer_param_groups(optimizer, names), io.optimizer_param_shapes(optimizer, names)
    )
    scaler = find_loss_scaler(optimizer)
    if scaler is not None:  # fp16: resuming must continue with the same loss scale
        header["loss_scaler"] = scaler.state_dict()

    directory = path.is_dir()

    def write(states: Iterator[tuple[str, dict[str, Any]]]) -> None:
        if shard:
            with atomic_directory(path, owned_optimizer_files(prefix)) as staging:
                save_optimizer_sharded(header, states, staging, prefix, max_bytes)
        elif directory:
            with atomic_directory(path, owned_optimizer_files(prefix)) as staging:
                target = staging / add_prefix(OPTIM_NAME, prefix)
                write_object_file({**header, "state": dict(states)}, target)
        else:
            write_object_file({**header, "state": dict(states)}, path)

    def produce() -> Iterator[tuple[str, dict[str, Any]]]:
        return io.optimizer_state_items(optimizer, names, gather_dtensor)

    io.collective_save(produce, write, path, use_async)


def clone_tree(obj: Any) -> Any:
    """Copy every tensor in a nested structure (loaded files are memory-mapped)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    return obj


def load_optimizer(
    io: CheckpointIO, optimizer: OptimizerLike, checkpoint: str | os.PathLike[str]
) -> LoadReport:
    """Load an optimizer checkpoint into ``optimizer``, matching parameters by name.

    Every parameter of the target must be in the checkpoint with the same global shape, and
    nothing else may be; the difference is reported in one error before anything is loaded.
    Full states are handed to ``io.load_optimizer_state``, which re-slices them for this rank.
    A plain ``torch.optim`` state dict is loaded positionally.

    Returns:
        An empty :class:`LoadReport`.

    Raises:
        CheckpointMismatchError: missing, unexpected or wrongly shaped parameters.
        CheckpointError: a missing, corrupt or truncated file (named in the message).
    """
    source = find_optimizer_checkpoint(checkpoint)
    if source.is_torch_state_dict():
        _log.warning(
            "%r is a plain torch optimizer state dict; loading it by position.", str(source.path)
        )
        unwrap_optimizer(optimizer).load_state_dict(clone_tree(source.torch_state_dict()))
        return LoadReport()
    header = source.header()
    names = io.optimizer_param_names(optimizer)
    shapes = io.optimizer_param_shapes(optimizer, names)
    mapping, report = match_optimizer(names, shapes, header)
    finish_report(report, "optimizer", source.path, strict=True)
    if any(is_positional_name(n) for group in names for n in group) or not header.get("named"):
        _log.warning("loading optimizer checkpoint %r by position.", str(source.path))
    io.load_optimizer_state(optimizer, names, header, source.iter_states(), mapping)
    scaler, saved = find_loss_scaler(optimizer), header.get("loss_scaler")
    if scaler is not None and isinstance(saved, dict):
        scaler.load_state_dict(saved)
    return report


def find_loss_scaler(optimizer: Any) -> LossScaler | None:
    """The fp16 loss scaler of a boosted optimizer (``None`` for a plain torch optimizer or
    without loss scaling): see :meth:`kolossos.interface.OptimizerWrapper.get_loss_scaler`."""
    return optimizer.get_loss_scaler() if isinstance(optimizer, OptimizerWrapper) else None
