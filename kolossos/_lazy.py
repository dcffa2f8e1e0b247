"""Lazy re-exports: a package names objects that live in modules it must not import eagerly
(heavy ones, or ones of a higher layer), and resolves each on first access."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, namespace: dict[str, Any], table: Mapping[str, tuple[str, str | None]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for ``table``: exported name
    -> ``(module, attribute)`` (``attribute=None``: the module itself). A resolved value is
    cached in ``namespace`` (the package's ``globals()``), so each is imported once.

    Example:
        >>> __getattr__, __dir__ = lazy_attributes(
        ...     __name__, globals(), {"Booster": ("kolossos.booster", "Booster")}
        ... )  # doctest: +SKIP
    """

    def getattr_(name: str) -> Any:
        entry = table.get(name)
        if entry is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = entry
        value = importlib.import_module(module)
        if attribute is not None:
            value = getattr(value, attribute)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(table))

    return getattr_, dir_
