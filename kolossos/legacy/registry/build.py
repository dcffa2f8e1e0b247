"""Build an object from a config entry ``dict(type='Name', **kwargs)`` and a registry
(Colossal-AI's ``build_from_registry`` / ``build_from_config``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kolossos.legacy.registry.registry import Registry

__all__ = ["build_from_config", "build_from_registry"]


def build_from_config(module: Callable[..., Any], config: Mapping[str, Any]) -> Any:
    """``module(**config)``.

    Raises:
        TypeError: ``config`` is not a mapping, or ``module`` is not callable.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict of keyword arguments, got {type(config).__name__}.")
    if not callable(module):
        raise TypeError(f"module must be a class or function, got {module!r}.")
    return module(**config)


def build_from_registry(config: Mapping[str, Any], registry: Registry) -> Any:
    """Look ``config['type']`` up in ``registry`` and build it with the other entries.

    Raises:
        TypeError: ``config`` is not a mapping or has no string ``type``.
        NameError: ``type`` names nothing in ``registry``.

    Example:
        >>> from kolossos.legacy.registry import LAYERS
        >>> build_from_registry(dict(type="Linear", in_features=3, out_features=2), LAYERS)
        Linear(in_features=3, out_features=2, bias=True)
    """
    if not isinstance(config, Mapping) or not isinstance(config.get("type"), str):
        raise TypeError(
            f"a {registry.name} config must be a dict with a 'type' string naming a registered "
            f"class, e.g. dict(type='Linear', in_features=3, out_features=512); got {config!r}."
        )
    kwargs = dict(config)
    return build_from_config(registry.get_module(kwargs.pop("type")), kwargs)
