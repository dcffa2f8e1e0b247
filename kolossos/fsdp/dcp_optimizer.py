"""Optimizer state as a DCP directory, keyed by parameter name (see :mod:`kolossos.fsdp.dcp`).

The header is the name-keyed optimizer format's (``param_groups`` with names, global shapes), so
loading matches parameters by name and reports every difference before anything is loaded, as
:mod:`kolossos.checkpoint_io.optimizer_io` does for gathered checkpoints. Before DCP can read
into the target, every state tensor needs a home of the right layout: a state tensor shaped
like its parameter is laid out like it (a ``DTensor`` shard for a sharded parameter); anything
else (``step``, factored statistics) is a plain tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kolossos.checkpoint_io import CheckpointError, CheckpointIO, LoadReport
from kolossos.checkpoint_io.backends import read_object_file, write_object_file
from kolossos.checkpoint_io.optim_format import build_header, check_header, match_optimizer
from kolossos.checkpoint_io.param_names import unwrap_optimizer
from kolossos.checkpoint_io.state_check import finish_report
from kolossos.fsdp.dcp import dcp_kind, run_dcp, save_dcp

__all__ = ["OPTIM_HEADER_NAME", "load_optimizer_dcp", "save_optimizer_dcp"]

OPTIM_HEADER_NAME = "kolossos_optim_header.bin"


def _key(name: str, state_key: str) -> str:
    return f"state/{name}/{state_key}"


def _named_states(
    optimizer: Any, names: list[list[str]]
) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    optim = unwrap_optimizer(optimizer)
    for group, group_names in zip(optim.param_groups, names, strict=True):
        for param, name in zip(group["params"], group_names, strict=True):
            state = optim.state.get(param)
            if state:
                yield name, param, state


def save_optimizer_dcp(
    io: CheckpointIO, optimizer: Any, checkpoint: str | os.PathLike[str]
) -> None:
    """Save ``optimizer``'s state as a DCP directory, each rank writing its shards (collective)."""
    names = io.optimizer_param_names(optimizer)
    header = build_header(
        io.optimizer_param_groups(optimizer, names), io.optimizer_param_shapes(optimizer, names)
    )
    tensors: dict[str, Any] = {}
    tensor_meta: dict[str, dict[str, Any]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, _, state in _named_states(optimizer, names):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[_key(name, key)] = value
                dtype = str(value.dtype).removeprefix("torch.")
                tensor_meta.setdefault(name, {})[key] = (list(value.shape), dtype)
            else:
                scalars.setdefault(name, {})[key] = value
    header["dcp_tensors"] = tensor_meta
    header["dcp_scalars"] = scalars

    def add_header(staging: Path) -> None:
        write_object_file(header, staging / OPTIM_HEADER_NAME)

    save_dcp(io, tensors, checkpoint, "optimizer", add_header)


def _template(
    header: dict[str, Any], mapping: dict[str, str], params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Empty tensors, laid out as the target needs them, for every state tensor to load."""
    template: dict[str, torch.Tensor] = {}
    for saved, target in mapping.items():
        param = params[target]
        for key, (shape, dtype_name) in header["dcp_tensors"].get(saved, {}).items():
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown dtype {dtype_name!r} for {saved}/{key}")
            if tuple(shape) == tuple(param.shape):  # sliceable: this rank's shard only
                template[_key(saved, key)] = torch.empty_like(param, dtype=dtype)
            else:
                template[_key(saved, key)] = torch.empty(shape, dtype=dtype)
    return template


def load_optimizer_dcp(io: CheckpointIO, optimizer: Any, directory: Path) -> LoadReport:
    """Load a DCP optimizer checkpoint (saved at any world size) into ``optimizer``.

    Raises:
        CheckpointMismatchError: parameters missing, unexpected or of another shape.
        CheckpointError: not an optimizer checkpoint, or a damaged header.
    """
    import torch.distributed.checkpoint as dcp

    if dcp_kind(directory) != "optimizer":
        raise CheckpointError(
            f"{str(directory)!r} is a DCP checkpoint but not a kolossos optimizer checkpoint."
        )
    header = check_header(read_object_file(directory / OPTIM_HEADER_NAME), str(directory))
    if "dcp_tensors" not in header:
        raise CheckpointError(f"{str(directory)!r}: the optimizer header lacks 'dcp_tensors'.")
    names = io.optimizer_param_names(optimizer)
    mapping, report = match_optimizer(names, io.optimizer_param_shapes(optimizer, names), header)
    finish_report(report, "optimizer", directory, strict=True)
    optim = unwrap_optimizer(optimizer)
    params = {
        name: p
        for group, group_names in zip(optim.param_groups, names, strict=True)
        for p, name in zip(group["params"], group_names, strict=True)
    }
    template = _template(header, mapping, params)
    run_dcp(dcp.load, template, directory, io)  # collective

    def states() -> Iterator[tuple[str, dict[str, Any]]]:
        for saved in mapping:
            keys = header["dcp_tensors"].get(saved, {})
            state = {key: template[_key(saved, key)] for key in keys}
            state.update(header["dcp_scalars"].get(saved, {}))
            if state:
                yield saved, state

    io.load_optimizer_state(optimizer, names, header, states(), mapping)
    return report
