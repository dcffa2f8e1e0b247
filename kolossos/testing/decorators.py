"""Test decorators: parameter sweeps inside one process, and reruns on known flakes."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def parameterize(arg_name: str, values: Iterable[Any]) -> Callable[[F], F]:
    """Call the decorated function once per value of ``arg_name``, in this process.

    Unlike ``pytest.mark.parametrize`` this works inside a spawned rank, so one process group can
    serve a whole sweep. Stacked decorators give the cartesian product.

    Example:
        >>> @parameterize("n", [1, 2])
        ... def show(n):
        ...     print(n)
        >>> show()
        1
        2
    """
    choices = list(values)

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            if arg_name in kwargs:  # fixed by an outer caller
                fn(*args, **kwargs)
                return
            for value in choices:
                fn(*args, **{**kwargs, arg_name: value})

        return wrapper  # type: ignore[return-value]

    return decorator


def rerun_on_exception(
    exception_type: type[BaseException] = Exception,
    pattern: str | None = None,
    max_try: int = 5,
) -> Callable[[F], F]:
    """Retry the function (up to ``max_try`` runs) when it raises ``exception_type`` whose message
    matches the regular expression ``pattern`` (any message when ``None``)."""
    if max_try < 1:
        raise ValueError(f"max_try={max_try} must be >= 1.")
    regex = re.compile(pattern) if pattern is not None else None

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, max_try + 1):
                try:
                    return fn(*args, **kwargs)
                except exception_type as exc:
                    if regex is not None and not regex.search(str(exc)):
                        raise
                    if attempt == max_try:
                        raise
            return None

        return wrapper  # type: ignore[return-value]

    return decorator


def rerun_if_address_is_in_use(max_try: int = 5) -> Callable[[F], F]:
    """Retry when a port someone else took makes the run fail with "Address already in use"."""
    return rerun_on_exception(Exception, r"(?i)address already in use|EADDRINUSE", max_try)
