"""The contracts between engines, checkpoint IO and the Booster, as ``typing.Protocol`` types.

* :class:`LossScaler`: what optimizer checkpoints need of an fp16 loss scaler
  (:class:`kolossos.amp.BaseGradScaler` provides it).
* :class:`GradNormFn`: the global gradient norm of a model whose gradients are split across
  ranks (tensor-parallel shards, pipeline stages), for an optimizer wrapper's clipping.
* :class:`ParamStateOwner`: an optimizer wrapper holding the master copy and the optimizer state
  of model parameters in its own layout (ZeRO partitions, tensor-parallel shards). Checkpoint IO
  asks it for *full* values and gives it full values back; it never reads the layout itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

__all__ = ["GradNormFn", "LossScaler", "ParamStateOwner"]


class LossScaler(Protocol):
    """A loss scaler whose state travels with optimizer checkpoints."""

    @property
    def scale(self) -> float:
        """The current loss scale."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The state needed to resume."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""
        ...


class GradNormFn(Protocol):
    """Computes the ``norm_type``-norm of the whole model's gradients (a collective where the
    gradients are split across ranks).

    Called with ``(tensor holding the gradient, model parameter behind it)`` pairs: the first is
    what the optimizer steps (a master copy, or the parameter itself), the second tells which
    parallel layout the gradient has."""

    def __call__(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], norm_type: float
    ) -> torch.Tensor:
        """The global norm, a 0-dim tensor, the same on every rank that takes part."""
        ...


class ParamStateOwner(Protocol):
    """An optimizer wrapper that owns the master values and states of model parameters.

    "Full" means full over the owner's own sharding (its data-parallel partitions); a
    tensor-parallel owner still returns this rank's tensor-parallel shard, which the checkpoint
    IO gathers.
    """

    @property
    def groups(self) -> Sequence[Sequence[torch.Tensor]]:
        """The model parameters it manages, group by group (checkpoint order)."""
        ...

    def param_name(self, param: torch.Tensor) -> str | None:
        """The name of model parameter ``param``, if known."""
        ...

    def unwrap(self) -> Optimizer:
        """The innermost torch optimizer (its param groups carry the hyper-parameters)."""
        ...

    def full_param(self, param: torch.Tensor, dst: int | None) -> torch.Tensor | None:
        """``param``'s value at master precision (a collective when the owner is sharded; with
        ``dst`` only that rank receives it, the others get ``None``)."""
        ...

    def load_full_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``param`` (its working copy and its master) from a full ``value``."""
        ...

    def full_param_states(self, dst: int | None) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """Yield ``(group, index, full state)`` per parameter with optimizer state (a
        collective when sharded)."""
        ...

    def load_param_states(self, items: Iterable[tuple[int, int, Mapping[str, Any]]]) -> None:
        """Replace the optimizer state by ``(group, index, full state)`` items."""
        ...
