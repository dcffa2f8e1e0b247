"""Helpers shared by the family policies: finding the base model inside a task model, reading
config sizes, and the heads that stay replicated."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["block_count", "config_of", "find_base", "head_paths", "is_class", "join"]


def is_class(model: nn.Module, *names: str) -> bool:
    """Whether ``model``'s class, or one of its bases, is named one of ``names``."""
    return any(cls.__name__ in names for cls in type(model).__mro__)


def find_base(model: nn.Module, base_class: str, attribute: str) -> tuple[nn.Module, str]:
    """The base model (an instance of ``base_class``) and its path prefix inside ``model``
    (``""`` when ``model`` is the base model itself, else ``attribute + "."``).

    Raises:
        ValueError: neither ``model`` nor ``model.<attribute>`` is a ``base_class``.
    """
    if is_class(model, base_class):
        return model, ""
    inner = getattr(model, attribute, None)
    if isinstance(inner, nn.Module) and is_class(inner, base_class):
        return inner, attribute + "."
    raise ValueError(
        f"{type(model).__name__}: expected a {base_class} at .{attribute}; the plan cannot locate "
        "the transformer body of this model. Pass a custom policy (see docs/shardformer.md)."
    )


def config_of(model: nn.Module) -> Any:
    """The model's transformers config.

    Raises:
        ValueError: the model has no ``config``.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config; is it a transformers model?")
    return config


def join(prefix: str, *paths: str) -> tuple[str, ...]:
    """``paths`` with ``prefix`` prepended."""
    return tuple(prefix + path for path in paths)


def block_count(model: nn.Module, blocks_path: str) -> int:
    """Number of modules in the block list at ``blocks_path``."""
    blocks = model.get_submodule(blocks_path)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{blocks_path!r} is a {type(blocks).__name__}, not an nn.ModuleList.")
    return len(blocks)


def head_paths(model: nn.Module, candidates: tuple[str, ...]) -> tuple[str, ...]:
    """The candidate head modules ``model`` really has (direct children, not ``None``)."""
    return tuple(name for name in candidates if isinstance(getattr(model, name, None), nn.Module))
