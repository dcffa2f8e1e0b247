"""``Registry``: classes registered by name, so a config can name them as strings."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry:
    """A name → class table; ``get_module`` also looks into third-party modules.

    Args:
        name: the registry's name (used in error messages).
        third_party_library: modules searched by attribute when a name is not registered
            (e.g. ``torch.nn`` for layers).

    Example:
        >>> MODELS = Registry("models")
        >>> @MODELS.register_module
        ... class Tiny: ...
        >>> MODELS.get_module("Tiny") is Tiny
        True
    """

    def __init__(self, name: str, third_party_library: Sequence[ModuleType] | None = None) -> None:
        self._name = name
        self._registry: dict[str, Any] = {}
        self._third_party_lib = list(third_party_library or [])

    @property
    def name(self) -> str:
        """The registry's name."""
        return self._name

    def register_module(self, module_class: T) -> T:
        """Register a class under its ``__name__`` (usable as a decorator).

        Raises:
            KeyError: a class of that name is registered already.
        """
        module_name = getattr(module_class, "__name__", None)
        if not isinstance(module_name, str):
            raise TypeError(f"{self._name}: register_module needs a class, got {module_class!r}.")
        if module_name in self._registry and self._registry[module_name] is not module_class:
            raise KeyError(
                f"{module_name!r} is registered in {self._name!r} already; give the new class "
                "another name."
            )
        self._registry[module_name] = module_class
        return module_class

    def get_module(self, module_name: str) -> Any:
        """The class registered (or found in a third-party module) as ``module_name``.

        Raises:
            NameError: nothing of that name is known.
        """
        if module_name in self._registry:
            return self._registry[module_name]
        for lib in self._third_party_lib:
            if hasattr(lib, module_name):
                return getattr(lib, module_name)
        known = ", ".join(sorted(self._registry)) or "nothing yet"
        raise NameError(
            f"{module_name!r} is not in the registry {self._name!r} (registered: {known}); "
            f"decorate the class with @{self._name.upper()}.register_module."
        )

    def has(self, module_name: str) -> bool:
        """Whether ``module_name`` is registered or found in a third-party module."""
        return module_name in self._registry or any(
            hasattr(lib, module_name) for lib in self._third_party_lib
        )
