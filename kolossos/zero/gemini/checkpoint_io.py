"""``GeminiCheckpointIO``: portable checkpoints of Gemini (chunk-based ZeRO-3) models and
optimizers.

* **Model**: Hugging Face's layouts (``docs/checkpoint.md``). The full tensors are gathered
  chunk by chunk (:meth:`GeminiDDP.named_full_tensors`, a collective): at most one chunk's
  parameters exist in full at a time, and the writer (data-parallel rank 0) plans and writes
  shard files as the tensors arrive, so no rank ever holds the whole model when the model is
  sharded. Parameters come from their fp32 masters when the optimizer keeps some, so a resumed
  run continues exactly and other plugins load full-precision weights. Tied weights are stored
  once, under their first name.
* **Optimizer**: the name-keyed format (version 1). Each parameter's states are gathered chunk
  by chunk (:meth:`GeminiOptimizer.full_state_items`) and written as they come; on load every
  rank keeps its slice of each full state (:meth:`GeminiOptimizer.load_full_states`). Checkpoints
  therefore move between world sizes and to and from ``LowLevelZeroPlugin``, ``TorchDDPPlugin``
  and a single process, as long as the wrapped optimizer is of the same kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from kolossos.checkpoint_io import CheckpointIO
from kolossos.checkpoint_io._common import boosted
from kolossos.checkpoint_io.errors import CheckpointError
from kolossos.checkpoint_io.optim_format import load_group_hyperparameters
from kolossos.checkpoint_io.param_names import unwrap_optimizer
from kolossos.checkpoint_io.read_plan import ReadPlan
from kolossos.checkpoint_io.state_check import ModelLayout
from kolossos.zero.gemini.colo_params import has_tp_params, tp_full_shapes, tp_full_tensors
from kolossos.zero.gemini.gemini_ddp import GeminiDDP
from kolossos.zero.gemini.gemini_optimizer import GeminiOptimizer

__all__ = ["GeminiCheckpointIO"]


def _ddp(model: nn.Module) -> GeminiDDP:
    return boosted(model, GeminiDDP, "GeminiCheckpointIO", "GeminiPlugin", "model")


def _gemini(optimizer: Any) -> GeminiOptimizer:
    opt = boosted(optimizer, GeminiOptimizer, "GeminiCheckpointIO", "GeminiPlugin", "optimizer")
    _no_tp(opt.module, "optimizer checkpoints")
    return opt


def _no_tp(model: GeminiDDP, what: str) -> None:
    if has_tp_params(model.module):
        raise NotImplementedError(
            f"GeminiCheckpointIO: {what} of a model over tensor-parallel ColoParameters are not "
            "supported; save the model with booster.save_model (full Hugging Face tensors)."
        )


class GeminiCheckpointIO(CheckpointIO):
    """Checkpoint IO of :class:`~kolossos.booster.plugin.GeminiPlugin` (module doc).

    Args:
        process_group: the data-parallel group (its rank 0 writes).
    """

    # ------------------------------------------------------------------ model
    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The full state, chunk by chunk (every rank takes part in each gather)."""
        if not gather_dtensor:
            raise NotImplementedError(
                "gather_dtensor=False (each rank writing its own chunk shards) is not supported "
                "by GeminiCheckpointIO; save with gather_dtensor=True (the default)."
            )
        ddp = _ddp(model)  # tensor-parallel pieces are gathered over their tp group too
        yield from tp_full_tensors(ddp.module, ddp.named_full_tensors())

    def model_layout(self, model: nn.Module) -> ModelLayout:
        """Global shapes of every state-dict name (tied names included) and the tied names."""
        ddp = _ddp(model)
        shapes = tp_full_shapes(ddp.module, dict(ddp.full_shapes()))
        return ModelLayout(shapes, dict(ddp.tied_aliases()))

    def model_read_plan(self, model: nn.Module) -> ReadPlan:
        """Skip the parameters that lie wholly in other ranks' chunk shards."""
        return dict.fromkeys(_ddp(model).names_not_held())

    def load_model_piece(self, model: nn.Module, piece: dict[str, torch.Tensor]) -> None:
        """Each rank copies its slice of every tensor into its chunk shards (no communication)."""
        ddp = _ddp(model)
        _no_tp(ddp, "loading model checkpoints")
        aliases = ddp.tied_aliases()
        items = {aliases.get(name, name): tensor for name, tensor in piece.items()}
        consumed = ddp.load_full_tensors(items.items())
        left = sorted(set(items) - set(consumed))
        if left:
            raise CheckpointError(
                f"GeminiDDP did not take {len(left)} checkpoint tensors (e.g. {left[0]!r}) "
                "although the model lists them"
            )

    # ------------------------------------------------------------------ optimizer
    def optimizer_param_names(self, optimizer: Any) -> list[list[str]]:
        """The state-dict name of each parameter of the user's optimizer, group by group."""
        return [list(group) for group in _gemini(optimizer).param_names()]

    def optimizer_param_shapes(
        self, optimizer: Any, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """The parameters' global shapes."""
        shapes = _gemini(optimizer).module.full_shapes()
        return {name: tuple(shapes[name]) for group in names for name in group}

    def optimizer_state_items(
        self, optimizer: Any, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each parameter's full states, gathered chunk by chunk (a collective)."""
        if not gather_dtensor:
            raise NotImplementedError(
                "gather_dtensor=False is not supported by GeminiCheckpointIO; save with "
                "gather_dtensor=True (the default)."
            )
        yield from _gemini(optimizer).full_state_items()

    def load_optimizer_state(
        self,
        optimizer: Any,
        names: list[list[str]],
        header: dict[str, Any],
        states: Iterator[tuple[str, dict[str, Any]]],
        mapping: dict[str, str],
    ) -> None:
        """Hyper-parameters per group (from the saved group holding its parameters), then each
        parameter's full states, of which every rank keeps its slice, as they stream in."""
        opt = _gemini(optimizer)
        load_group_hyperparameters(unwrap_optimizer(opt), names, header, mapping)
        opt.load_full_states((mapping[name], state) for name, state in states if name in mapping)
