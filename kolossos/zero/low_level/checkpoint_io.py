"""``LowLevelZeroCheckpointIO``: portable checkpoints of ZeRO-1/2 models and optimizers.

* **Model**: the full state dict in Hugging Face's layouts. Every rank holds the working weights,
  but with fp16/bf16 they are rounded copies: the fp32 master values are gathered instead, one
  parameter at a time, point-to-point to the writer (data-parallel rank 0), so a resumed run
  continues exactly and other plugins load full-precision weights. With fp32 the working
  weights *are* the masters and the writer saves them without communication.
* **Optimizer**: the name-keyed format of ``docs/checkpoint.md``. Each parameter's states are
  gathered from the partitions holding its pieces to the writer, parameter by parameter (peak
  memory: one parameter's states); on load every rank cuts its partition out of the full
  states, so a checkpoint moves between world sizes, and to and from ``TorchDDPPlugin`` or a
  single process.

The ZeRO optimizer owning a parameter is looked up in the plugin's
:class:`~kolossos.interface.ParamOwners` registry by the parameter itself, so the hooks work for
the boosted model and the unwrapped module alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from kolossos.checkpoint_io import CheckpointIO
from kolossos.checkpoint_io._common import boosted
from kolossos.checkpoint_io.optim_format import load_group_hyperparameters
from kolossos.checkpoint_io.param_names import positional_name
from kolossos.checkpoint_io.state_check import ModelLayout
from kolossos.interface import ParamOwners, unwrap_model
from kolossos.zero.low_level.low_level_optim import LowLevelZeroOptimizer

__all__ = ["LowLevelZeroCheckpointIO"]


def _zero(optimizer: Any) -> LowLevelZeroOptimizer:
    return boosted(
        optimizer, LowLevelZeroOptimizer, "LowLevelZeroCheckpointIO", "LowLevelZeroPlugin",
        "optimizer",
    )  # fmt: skip


class LowLevelZeroCheckpointIO(CheckpointIO):
    """Checkpoint IO of :class:`~kolossos.booster.plugin.LowLevelZeroPlugin` (module doc).

    Args:
        process_group: the data-parallel group (its rank 0 writes).
        owners: which ZeRO optimizer owns each model parameter (the plugin's registry); a
            parameter without an owner is saved and loaded as it is.
    """

    def __init__(self, process_group: Any | None = None, owners: ParamOwners | None = None) -> None:
        super().__init__(process_group)
        self.owners = owners if owners is not None else ParamOwners()

    def _owner(self, tensor: torch.Tensor) -> LowLevelZeroOptimizer | None:
        owner = self.owners.owner_of(tensor)
        return owner if isinstance(owner, LowLevelZeroOptimizer) else None

    # ------------------------------------------------------------------ model
    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The full state dict; fp16/bf16 parameters come from their gathered fp32 masters."""
        module = unwrap_model(model)
        tensors = module.state_dict(keep_vars=True)
        owners = {self._owner(v) for v in tensors.values()} - {None}
        exact = all(all(opt.masters.aliased) for opt in owners if opt is not None)
        if exact and not self.is_writer():
            return
        # tied names share one tensor: gathered once (on every rank, or a rank that receives
        # nothing would gather again and the ranks' collectives would no longer match)
        seen: dict[torch.Tensor, torch.Tensor | None] = {}
        for name, value in tensors.items():
            opt = self._owner(value)
            if opt is None or all(opt.masters.aliased):
                if self.is_writer():
                    yield name, value.detach()
                continue
            if value not in seen:
                seen[value] = opt.full_param(value, dst=0)  # collective: every rank takes part
            full = seen[value]
            if full is not None:
                yield name, full

    def model_layout(self, model: nn.Module) -> ModelLayout:
        """Names and shapes of the unwrapped model's state dict."""
        return ModelLayout.of_state_dict(unwrap_model(model).state_dict())

    def load_model_piece(self, model: nn.Module, piece: dict[str, torch.Tensor]) -> None:
        """Managed parameters go to the working weights and (at full precision) to this rank's
        master slice; everything else through ``load_state_dict``."""
        module = unwrap_model(model)
        targets = module.state_dict(keep_vars=True)
        rest = {}
        for name, value in piece.items():
            target = targets[name]
            opt = self._owner(target)
            if opt is None:
                rest[name] = value
            else:
                opt.load_full_param(target, value)
        if rest:
            module.load_state_dict(rest, strict=False)

    # ------------------------------------------------------------------ optimizer
    def optimizer_param_names(self, optimizer: Any) -> list[list[str]]:
        """Names given at ``boost`` (``set_param_names``), else positional names."""
        opt = _zero(optimizer)
        return [
            [opt.param_name(p) or positional_name(g, j) for j, p in enumerate(group)]
            for g, group in enumerate(opt.groups)
        ]

    def optimizer_param_shapes(
        self, optimizer: Any, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """The parameters' full shapes."""
        opt = _zero(optimizer)
        return {
            name: tuple(p.shape)
            for group, group_names in zip(opt.groups, names, strict=True)
            for p, name in zip(group, group_names, strict=True)
        }

    def optimizer_state_items(
        self, optimizer: Any, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each parameter's full states, gathered to the writer (a collective)."""
        for g, i, state in _zero(optimizer).full_param_states(dst=0):
            yield names[g][i], state

    def load_optimizer_state(
        self,
        optimizer: Any,
        names: list[list[str]],
        header: dict[str, Any],
        states: Iterator[tuple[str, dict[str, Any]]],
        mapping: dict[str, str],
    ) -> None:
        """Hyper-parameters per group (from the saved group holding its parameters), and each
        parameter's states cut to this rank's partition as they stream in."""
        opt = _zero(optimizer)
        load_group_hyperparameters(opt.optim, names, header, mapping)
        position = {n: (g, i) for g, group in enumerate(names) for i, n in enumerate(group)}
        opt.load_param_states(
            (*position[mapping[name]], state) for name, state in states if name in mapping
        )
