"""Which name each optimizer parameter has, so optimizer checkpoints are keyed by name.

A torch optimizer only knows its parameters by position. The Booster calls
:func:`register_param_names` after ``boost``; from then on :func:`optimizer_param_names` returns the
model's names (``model.named_parameters()`` of the unwrapped model, each tied parameter once).
Without a registration the names fall back to positions, ``param_groups[i].params[j]``, and a
warning says so: such a checkpoint only loads into an optimizer with the same groups in the same
order.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.interface import OptimizerWrapper, unwrap_model

__all__ = [
    "is_positional_name",
    "optimizer_param_names",
    "positional_name",
    "register_param_names",
    "unwrap_optimizer",
]

# torch optimizer -> weak reference to the model, or an explicit {id(param): name} mapping.
_REGISTRY: weakref.WeakKeyDictionary[Optimizer, Any] = weakref.WeakKeyDictionary()


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The innermost ``torch.optim.Optimizer`` of an :class:`OptimizerWrapper` (or itself).

    Raises:
        TypeError: ``optimizer`` is neither.
    """
    if isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.unwrap()
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            "expected a torch.optim.Optimizer or an OptimizerWrapper, got "
            f"{type(optimizer).__name__}"
        )
    return optimizer


def register_param_names(
    optimizer: Optimizer | OptimizerWrapper, model: nn.Module | Mapping[torch.Tensor, str]
) -> None:
    """Remember that ``optimizer`` updates the parameters of ``model``, for name-keyed checkpoints.

    Args:
        optimizer: the optimizer (wrapped or not).
        model: the model (wrappers and DDP are stripped when names are resolved), or an explicit
            ``{parameter: name}`` mapping for optimizers whose parameters are not the model's
            (e.g. master copies).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> register_param_names(opt, model)
        >>> optimizer_param_names(opt)
        [['weight', 'bias']]
    """
    optim = unwrap_optimizer(optimizer)
    if isinstance(model, nn.Module):
        _REGISTRY[optim] = weakref.ref(model)
    elif isinstance(model, Mapping):
        _REGISTRY[optim] = {id(p): str(name) for p, name in model.items()}
    else:
        raise TypeError(
            "model must be an nn.Module or a {parameter: name} mapping, got "
            f"{type(model).__name__}"
        )


def positional_name(group: int, position: int) -> str:
    """The fallback name of parameter ``position`` in group ``group``."""
    return f"param_groups[{group}].params[{position}]"


def is_positional_name(name: str) -> bool:
    """Whether ``name`` is a positional fallback name."""
    return name.startswith("param_groups[")


def _names_by_id(optim: Optimizer, model: nn.Module | None) -> dict[int, str] | None:
    entry = _REGISTRY.get(optim)
    if model is None and entry is not None:
        if isinstance(entry, dict):
            return entry
        model = entry()
    if model is None:
        return None
    return {id(p): name for name, p in unwrap_model(model).named_parameters()}


def optimizer_param_names(
    optimizer: Optimizer | OptimizerWrapper, model: nn.Module | None = None
) -> list[list[str]]:
    """Return the name of every parameter of ``optimizer``, group by group, in group order.

    Names come from ``model`` if given, else from the registration; parameters the model does not
    know (and every parameter when nothing is known) get positional names.

    Args:
        optimizer: the optimizer (wrapped or not).
        model: the model whose parameters the optimizer updates (overrides the registration).

    Raises:
        ValueError: the optimizer holds the same parameter twice.
    """
    optim = unwrap_optimizer(optimizer)
    by_id = _names_by_id(optim, model) or {}
    names: list[list[str]] = []
    seen: set[int] = set()
    for g, group in enumerate(optim.param_groups):
        group_names = []
        for j, param in enumerate(group["params"]):
            if id(param) in seen:
                raise ValueError(
                    f"the optimizer holds one parameter twice (group {g}, position {j}); "
                    "each parameter may appear in one param group only."
                )
            seen.add(id(param))
            group_names.append(by_id.get(id(param), positional_name(g, j)))
        names.append(group_names)
    return names
