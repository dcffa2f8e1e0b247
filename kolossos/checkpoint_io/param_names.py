"""Which name each optimizer parameter has, so optimizer checkpoints are keyed by name.

A torch optimizer only knows its parameters by position. Names live on the optimizer object
they describe: a boosted optimizer (an :class:`~kolossos.interface.OptimizerWrapper`) gets them
from ``booster.boost`` (:meth:`~kolossos.interface.OptimizerWrapper.set_param_names`); a plain
torch optimizer gets them from :func:`register_param_names`. Without names the checkpoint falls
back to positions, ``param_groups[i].params[j]``, and a warning says so: such a checkpoint only
loads into an optimizer with the same groups in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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

#: where register_param_names keeps a plain torch optimizer's names (on the optimizer itself)
_NAMES_ATTR = "_kolossos_param_names"


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


def _names_of(model: nn.Module | Mapping[torch.Tensor, str]) -> dict[torch.Tensor, str]:
    if isinstance(model, nn.Module):
        return {p: name for name, p in unwrap_model(model).named_parameters()}
    if isinstance(model, Mapping):
        return {p: str(name) for p, name in model.items()}
    raise TypeError(
        f"model must be an nn.Module or a {{parameter: name}} mapping, got {type(model).__name__}"
    )


def register_param_names(
    optimizer: Optimizer | OptimizerWrapper, model: nn.Module | Mapping[torch.Tensor, str]
) -> None:
    """Remember that ``optimizer`` updates the parameters of ``model``, for name-keyed checkpoints.

    The names are resolved now and stored on the optimizer.

    Args:
        optimizer: the optimizer (wrapped or not).
        model: the model (wrappers and DDP are stripped), or an explicit ``{parameter: name}``
            mapping (for optimizers whose parameters are not the model's).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> register_param_names(opt, model)
        >>> optimizer_param_names(opt)
        [['weight', 'bias']]
    """
    names = _names_of(model)
    if isinstance(optimizer, OptimizerWrapper):
        optimizer.set_param_names(names)
    else:
        vars(unwrap_optimizer(optimizer))[_NAMES_ATTR] = names


def positional_name(group: int, position: int) -> str:
    """The fallback name of parameter ``position`` in group ``group``."""
    return f"param_groups[{group}].params[{position}]"


def is_positional_name(name: str) -> bool:
    """Whether ``name`` is a positional fallback name."""
    return name.startswith("param_groups[")


def _lookup(
    optimizer: Any, optim: Optimizer, model: nn.Module | None
) -> Callable[[torch.Tensor], str | None]:
    """A function giving the name of a tensor the torch optimizer steps (or ``None``)."""
    wrapper = optimizer if isinstance(optimizer, OptimizerWrapper) else None
    mirror: dict[torch.Tensor, torch.Tensor] = {}
    if wrapper is not None:
        mirror = dict(zip(wrapper.parameters(), wrapper.working_params(), strict=True))
    if model is not None:
        table: Mapping[torch.Tensor, str] = _names_of(model)
    elif wrapper is not None and wrapper.has_param_names():
        return lambda p: wrapper.param_name(mirror.get(p, p))
    else:
        table = vars(optim).get(_NAMES_ATTR) or {}
    return lambda p: table.get(mirror.get(p, p))


def optimizer_param_names(
    optimizer: Optimizer | OptimizerWrapper, model: nn.Module | None = None
) -> list[list[str]]:
    """Return the name of every parameter of ``optimizer``, group by group, in group order.

    Names come from ``model`` if given, else from the names stored on the optimizer; a master
    copy is named after the model parameter it mirrors. Parameters without a name (every
    parameter when nothing is known) get positional names.

    Args:
        optimizer: the optimizer (wrapped or not).
        model: the model whose parameters the optimizer updates (overrides the registration).

    Raises:
        ValueError: the optimizer holds the same parameter twice.
    """
    optim = unwrap_optimizer(optimizer)
    lookup = _lookup(optimizer, optim, model)
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
            group_names.append(lookup(param) or positional_name(g, j))
        names.append(group_names)
    return names
