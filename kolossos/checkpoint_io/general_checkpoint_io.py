"""``GeneralCheckpointIO``: checkpoints of replicated state (no plugin, ``TorchDDPPlugin``).

Every rank holds the whole model and optimizer, so rank 0 writes and every rank loads. Tensors
that are ``DTensor`` (e.g. after ``torch.distributed.tensor.parallel``) are gathered into full
tensors when saving (all ranks take part) and cut back into each rank's slice when loading.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from kolossos.checkpoint_io.checkpoint_io_base import CheckpointIO, OptimizerLike
from kolossos.checkpoint_io.optim_format import to_torch_state_dict
from kolossos.checkpoint_io.param_names import optimizer_param_names, unwrap_optimizer
from kolossos.checkpoint_io.state_check import ModelLayout
from kolossos.interface import unwrap_model

__all__ = ["GeneralCheckpointIO"]


def _is_dtensor(value: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before its import
    return module is not None and isinstance(value, module.DTensor)


def _full(value: Any, gather_dtensor: bool) -> Any:
    if not _is_dtensor(value):
        return value
    if not gather_dtensor:
        raise NotImplementedError(
            "gather_dtensor=False (each rank saving its own DTensor shards) is not supported by "
            "GeneralCheckpointIO; save with gather_dtensor=True."
        )
    return value.full_tensor()  # collective: every rank runs the same sequence


def _like(value: torch.Tensor, target: Any) -> Any:
    """``value`` (a full tensor) laid out like ``target`` (cut into its DTensor slice)."""
    if not _is_dtensor(target) or _is_dtensor(value) or tuple(value.shape) != tuple(target.shape):
        return value
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank has the full tensor and keeps its slice, no communication.
    return distribute_tensor(
        value.to(target.device), target.device_mesh, target.placements, src_data_rank=None
    )


class GeneralCheckpointIO(CheckpointIO):
    """Checkpoint IO for replicated state: rank 0 writes, all ranks wait for it, all ranks load.

    Used without a plugin and by ``TorchDDPPlugin``. Formats, atomicity and validation come from
    :class:`CheckpointIO`.

    Example:
        >>> io = GeneralCheckpointIO()
        >>> io.save_model(model, "ckpt/model", shard=True, use_safetensors=True)
        >>> io.save_optimizer(optimizer, "ckpt/optim", shard=True)
        >>> io.load_model(model, "ckpt/model"); io.load_optimizer(optimizer, "ckpt/optim")
    """

    # ------------------------------------------------------------------ model
    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The unwrapped model's state dict; non-writers yield nothing unless DTensors need
        gathering."""
        state = unwrap_model(model).state_dict()
        collective = any(_is_dtensor(v) for v in state.values())
        if not collective and not self.is_writer():
            return
        for name, value in state.items():
            yield name, _full(value, gather_dtensor)

    def model_layout(self, model: nn.Module) -> ModelLayout:
        """Names and (global) shapes of the unwrapped model's state dict."""
        return ModelLayout.of_state_dict(unwrap_model(model).state_dict())

    def place(self, value: Any, target: Any) -> Any:
        """``value`` (a full tensor, or any state value) laid out like ``target`` for loading:
        cut into ``target``'s ``DTensor`` slice; anything else unchanged. Subclasses whose
        tensors are sharded differently override this one method."""
        return _like(value, target)

    def load_model_piece(self, model: nn.Module, piece: dict[str, torch.Tensor]) -> None:
        """``load_state_dict(strict=False)`` of the piece, each value :meth:`place`-d like the
        model's tensor (module load hooks run as usual)."""
        module = unwrap_model(model)
        targets = module.state_dict(keep_vars=True)
        piece = {name: self.place(value, targets[name]) for name, value in piece.items()}
        module.load_state_dict(piece, strict=False)

    # ------------------------------------------------------------------ optimizer
    def optimizer_param_names(self, optimizer: OptimizerLike) -> list[list[str]]:
        """Names from the model registered with ``register_param_names`` (else positional)."""
        return optimizer_param_names(optimizer)

    def optimizer_param_shapes(
        self, optimizer: OptimizerLike, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """Each parameter's (global) shape."""
        optim = unwrap_optimizer(optimizer)
        return {
            name: tuple(p.shape)
            for group, group_names in zip(optim.param_groups, names, strict=True)
            for p, name in zip(group["params"], group_names, strict=True)
        }

    def optimizer_state_items(
        self, optimizer: OptimizerLike, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each parameter's state (no copies; DTensor states gathered)."""
        optim = unwrap_optimizer(optimizer)
        collective = any(_is_dtensor(v) for s in optim.state.values() for v in s.values())
        if not collective and not self.is_writer():
            return
        for group, group_names in zip(optim.param_groups, names, strict=True):
            for param, name in zip(group["params"], group_names, strict=True):
                state = optim.state.get(param)
                if state:
                    yield name, {k: _full(v, gather_dtensor) for k, v in state.items()}

    def load_optimizer_state(
        self,
        optimizer: OptimizerLike,
        names: list[list[str]],
        header: dict[str, Any],
        states: Iterator[tuple[str, dict[str, Any]]],
        mapping: dict[str, str],
    ) -> None:
        """Build a positional state dict for the torch optimizer (each state value
        :meth:`place`-d like its parameter) and load it."""
        optim = unwrap_optimizer(optimizer)
        params = {
            name: p
            for group, group_names in zip(optim.param_groups, names, strict=True)
            for p, name in zip(group["params"], group_names, strict=True)
        }

        def laid_out() -> Iterator[tuple[str, dict[str, Any]]]:
            for name, state in states:
                if name in mapping:
                    target = params[mapping[name]]
                    yield name, {k: self.place(v, target) for k, v in state.items()}

        optim.load_state_dict(to_torch_state_dict(names, header, laid_out(), mapping))
