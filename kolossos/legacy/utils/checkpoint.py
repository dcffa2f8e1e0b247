"""The legacy checkpoint pair of the docs: ``save_checkpoint`` / ``load_checkpoint``.

One file holds the epoch, the model state, optionally the optimizer (in the name-keyed format of
``kolossos.checkpoint_io``) and the LR scheduler, plus any extra keyword values. Only states are
saved, so the model must be built before loading; the file loads under any number of processes or
parallel layout. Writes are atomic; rank 0 writes and every rank waits for it; every rank loads.

Tensor-parallel parameters (the legacy ``kolossos.nn`` layers under
``parallel=dict(tensor=dict(size=N, mode=...))`` in any mode, ``'1d'``, ``'2d'``, ``'2.5d'`` or
``'3d'``, whose parameters carry a shard mark read through
:func:`~kolossos.nn.layer.shard_layout.get_shard_layout`) are saved full, in the dense layer's
layout under the dense model's names (``fc1.weight`` as ``nn.Linear``'s ``(out, in)``, also
where a mode stores its blocks transposed): every rank takes part in gathering each shard (and
each optimizer state shaped like it), and rank 0 writes the full tensors. Loading cuts each
rank's shard back out of them, without communication, so a file saved in one mode loads in
another mode, in one process, under data parallelism, or at another tensor size.

Example:
    >>> save_checkpoint("ckpt.pt", epoch, model, optimizer, lr_scheduler, best_acc=0.93)
    >>> start_epoch = load_checkpoint("ckpt.pt", model, optimizer, lr_scheduler) + 1
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from kolossos.checkpoint_io._common import check_save_args, drain
from kolossos.checkpoint_io.backends import read_object_file, write_object_file
from kolossos.checkpoint_io.errors import CheckpointError
from kolossos.checkpoint_io.general_checkpoint_io import GeneralCheckpointIO, _full
from kolossos.checkpoint_io.optim_format import build_header, check_header, match_optimizer
from kolossos.checkpoint_io.optimizer_io import clone_tree
from kolossos.checkpoint_io.param_names import optimizer_param_names, unwrap_optimizer
from kolossos.checkpoint_io.state_check import (
    ModelLayout,
    compare_model_state,
    finish_report,
    unique_tensors,
)
from kolossos.interface import unwrap_model
from kolossos.nn.layer.shard_layout import get_shard_layout

__all__ = ["load_checkpoint", "save_checkpoint"]

LEGACY_FORMAT = "kolossos.checkpoint"
LEGACY_VERSION = 1
_RESERVED = ("format", "version", "epoch", "model", "optimizer", "lr_scheduler")


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    layout = get_shard_layout(tensor)
    return tuple(layout.full_shape) if layout is not None else tuple(tensor.shape)


def _is_shard_state(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state value is laid out like its (sharded) parameter."""
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == param.shape


class _LegacyCheckpointIO(GeneralCheckpointIO):
    """:class:`GeneralCheckpointIO` that also saves tensor-parallel shards full and cuts them
    back out when loading (see the module docstring)."""

    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in state-dict order: a collective of each tensor-parallel group when the
        model has sharded parameters (every rank must exhaust the iterator); rank 0 receives."""
        state = unwrap_model(model).state_dict(keep_vars=True)
        if not any(get_shard_layout(v) is not None for v in state.values()):
            yield from super().model_state_items(model, gather_dtensor)
            return
        for name, value in state.items():
            layout = get_shard_layout(value)
            # SYNC POINT: every rank gathers every sharded tensor, in state-dict order
            full = layout.gather(value.detach()) if layout else _full(value, gather_dtensor)
            if self.is_writer():
                yield name, full.detach()

    def model_layout(self, model: nn.Module) -> ModelLayout:
        """Names and full shapes of the model's state dict."""
        state = unwrap_model(model).state_dict(keep_vars=True)
        local = ModelLayout.of_state_dict(state)
        return ModelLayout({n: _full_shape(t) for n, t in state.items()}, local.aliases)

    def place(self, value: Any, target: Any) -> Any:
        """This rank's shard of a full (dense-layout) tensor when ``target`` is a
        tensor-parallel shard (no communication); otherwise as :class:`GeneralCheckpointIO`."""
        layout = get_shard_layout(target) if isinstance(target, torch.Tensor) else None
        if (
            layout is None
            or not isinstance(value, torch.Tensor)
            or tuple(value.shape) != tuple(layout.full_shape)
        ):
            return super().place(value, target)
        return layout.shard(value)

    def optimizer_param_shapes(
        self, optimizer: Any, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """Each parameter's full shape."""
        optim = unwrap_optimizer(optimizer)
        return {
            name: _full_shape(p)
            for group, group_names in zip(optim.param_groups, names, strict=True)
            for p, name in zip(group["params"], group_names, strict=True)
        }

    def optimizer_state_items(
        self, optimizer: Any, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each parameter's states, those of sharded parameters gathered to full size (a
        collective of each tensor-parallel group; every rank must exhaust the iterator)."""
        optim = unwrap_optimizer(optimizer)
        params = [p for group in optim.param_groups for p in group["params"]]
        if not any(get_shard_layout(p) is not None for p in params):
            yield from super().optimizer_state_items(optimizer, names, gather_dtensor)
            return
        for group, group_names in zip(optim.param_groups, names, strict=True):
            for param, name in zip(group["params"], group_names, strict=True):
                layout = get_shard_layout(param)
                state = optim.state.get(param)
                if not state:
                    continue  # no state on any rank: states exist once a step ran everywhere
                full = {
                    # SYNC POINT: every rank of the tensor group gathers the same states in order
                    k: layout.gather(v) if layout and _is_shard_state(k, v, param) else v
                    for k, v in state.items()
                }
                if self.is_writer():
                    yield name, full


def save_checkpoint(
    file: str | os.PathLike[str],
    epoch: int,
    model: nn.Module,
    optimizer: Any | None = None,
    lr_scheduler: Any | None = None,
    **kwargs: Any,
) -> None:
    """Save epoch, model, optimizer and LR scheduler states (and ``kwargs``) to one file.

    Args:
        file: the checkpoint file.
        epoch: the epoch number returned by :func:`load_checkpoint`.
        model: the model (boosted or not).
        optimizer: its optimizer (boosted or not); states are keyed by ``model``'s names.
        lr_scheduler: an LR scheduler.
        **kwargs: extra values stored under their names (tensors and plain data only).

    Raises:
        ValueError: a keyword collides with a reserved entry name.

    Example:
        >>> save_checkpoint("xxx.pt", epoch, model)
    """
    check_save_args(file, 1, None)
    clash = [k for k in kwargs if k in _RESERVED]
    if clash:
        raise ValueError(f"save_checkpoint keywords {clash} are reserved entry names; rename them.")
    io = _LegacyCheckpointIO()
    names = optimizer_param_names(optimizer, model) if optimizer is not None else []
    header = None
    if optimizer is not None:
        header = build_header(
            io.optimizer_param_groups(optimizer, names), io.optimizer_param_shapes(optimizer, names)
        )
    scheduler_state = lr_scheduler.state_dict() if lr_scheduler is not None else None

    def write() -> None:
        model_items = io.model_state_items(model, True)
        optim_items = io.optimizer_state_items(optimizer, names, True) if optimizer else iter(())
        try:
            if io.is_writer():
                body = {
                    "format": LEGACY_FORMAT,
                    "version": LEGACY_VERSION,
                    "epoch": epoch,
                    "model": dict(unique_tensors(model_items)),
                    "optimizer": None if header is None else {**header, "state": dict(optim_items)},
                    "lr_scheduler": scheduler_state,
                    **kwargs,
                }
                write_object_file(body, file)
        finally:
            drain(model_items)
            drain(optim_items)

    io.run_collective_write(write, file)


def _read(file: str | os.PathLike[str]) -> dict[str, Any]:
    body = read_object_file(file, mmap=True)
    if not isinstance(body, dict) or "model" not in body or "epoch" not in body:
        raise CheckpointError(
            f"{str(file)!r} is not a save_checkpoint file (no 'epoch' and 'model' entries)"
        )
    version = body.get("version", LEGACY_VERSION)
    if not isinstance(version, int) or version > LEGACY_VERSION:
        raise CheckpointError(
            f"{str(file)!r} has format version {version!r}; upgrade kolossos to load it"
        )
    return body


def load_checkpoint(
    file: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any | None = None,
    lr_scheduler: Any | None = None,
    strict: bool = True,
) -> int:
    """Load a :func:`save_checkpoint` file into already-built objects; return the saved epoch.

    Everything is validated (names and shapes of model and optimizer) before anything is loaded.

    Args:
        file: the checkpoint file.
        model: the model to load into (boosted or not, any parallel layout).
        optimizer: load its state too (the file must hold one).
        lr_scheduler: load its state too (the file must hold one).
        strict: raise on missing, unexpected or wrongly shaped entries; otherwise skip them.

    Raises:
        CheckpointMismatchError: ``strict`` and the states do not match.
        CheckpointError: a missing, corrupt or foreign file, or a requested state it lacks.

    Example:
        >>> epoch = load_checkpoint("xxx.pt", model)
    """
    body = _read(file)
    io = _LegacyCheckpointIO()
    model_state = body["model"]
    found = {n: (tuple(t.shape), str(t.dtype)) for n, t in model_state.items()}
    report, wanted = compare_model_state(io.model_layout(model), found)
    finish_report(report, "model", file, strict)
    optim_plan: tuple[Any, ...] | None = None
    if optimizer is not None:
        saved = body.get("optimizer")
        if not isinstance(saved, dict):
            raise CheckpointError(f"{str(file)!r} holds no optimizer state to load")
        if "format" not in saved:  # a plain torch state dict (positional)
            optim_plan = (saved, None, None, None)
        else:
            header = check_header({k: v for k, v in saved.items() if k != "state"}, str(file))
            names = optimizer_param_names(optimizer, model)
            shapes = io.optimizer_param_shapes(optimizer, names)
            mapping, optim_report = match_optimizer(names, shapes, header)
            finish_report(optim_report, "optimizer", file, strict)
            optim_plan = (saved, header, names, mapping)
    if lr_scheduler is not None and not isinstance(body.get("lr_scheduler"), dict):
        raise CheckpointError(f"{str(file)!r} holds no LR scheduler state to load")
    # Everything matched: now load.
    io.load_model_piece(model, {n: model_state[n] for n in wanted})
    if optim_plan is not None:
        saved, header, names, mapping = optim_plan
        if header is None:
            unwrap_optimizer(optimizer).load_state_dict(clone_tree(saved))
        else:
            io.load_optimizer_state(optimizer, names, header, iter(saved["state"].items()), mapping)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(body["lr_scheduler"])
    return int(body["epoch"])
