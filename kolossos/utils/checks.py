"""Argument checks shared by the configs: each names the value, the rule and the fix."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["check_flags"]


def check_flags(config: object, names: Iterable[str]) -> None:
    """Check that the fields ``names`` of ``config`` are booleans.

    Raises:
        TypeError: a field holding anything but ``True`` or ``False`` (named).

    Example:
        >>> class C:
        ...     verbose = 1
        >>> check_flags(C(), ["verbose"])
        Traceback (most recent call last):
        ...
        TypeError: verbose=1 must be True or False.
    """
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False.")
