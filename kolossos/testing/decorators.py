"""Test decorators: parameter sweeps inside one process, reruns on known flakes, and Colossal-AI's
:func:`clear_cache_before_run`, :func:`skip_if_not_enough_gpus` and :func:`run_on_environment_flag`.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
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

        # pytest reads a test's arguments from its signature: without this, decorating a test
        # function directly would make pytest look for a fixture named ``arg_name``
        signature = _without(fn, arg_name)
        if signature is not None:
            wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorator


def _without(fn: Callable[..., Any], name: str) -> inspect.Signature | None:
    """``fn``'s signature less the parameter ``name`` (``None`` where it has none)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature: nothing to hide
        return None
    params = [p for p in signature.parameters.values() if p.name != name]
    return signature.replace(parameters=params)


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


def clear_cache_before_run() -> Callable[[F], F]:
    """Collect garbage, then empty the accelerator's cache and reset its peak-memory statistics
    before each call of the decorated test (Colossal-AI's decorator of the same name).

    On CUDA, nothing is touched while this process has no CUDA context yet (there is no cache
    to empty then, and creating a context would force :func:`spawn` to give up forking).

    Example:
        >>> @clear_cache_before_run()
        ... def test_peak_memory():
        ...     ...
    """

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _clear_cache()
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorator


def _clear_cache() -> None:
    import torch

    from kolossos.accelerator import get_accelerator

    gc.collect()  # first, so the blocks of collected tensors are back in the cache to release
    accelerator = get_accelerator()
    if accelerator.name == "cuda" and not torch.cuda.is_initialized():
        return
    accelerator.synchronize()  # sync point: queued kernels may still use cached blocks
    accelerator.empty_cache()
    accelerator.reset_peak_memory_stats()


def skip_if_not_enough_gpus(min_gpus: int) -> Callable[[F], F]:
    """Skip the decorated test when fewer than ``min_gpus`` CUDA devices are visible; run it
    otherwise.

    The count is ``torch.cuda.device_count()``, taken when the test is called (it creates no
    CUDA context). Under pytest the test is reported as skipped (``pytest.skip``); without pytest
    the call returns ``None`` without running it. Decorate the test itself, not a function that
    runs inside :func:`spawn`'s ranks.

    Args:
        min_gpus: the number of CUDA devices the test needs (``>= 0``).

    Raises:
        ValueError: ``min_gpus`` is not a non-negative integer.

    Example:
        >>> @skip_if_not_enough_gpus(min_gpus=4)
        ... def test_tp4():
        ...     ...
    """
    if isinstance(min_gpus, bool) or not isinstance(min_gpus, int) or min_gpus < 0:
        raise ValueError(f"min_gpus={min_gpus!r} must be a non-negative integer, e.g. 2.")

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            import torch

            available = torch.cuda.device_count()
            if available >= min_gpus:
                return fn(*args, **kwargs)
            reason = f"needs {min_gpus} CUDA device(s), {available} visible"
            try:
                import pytest
            except ImportError:  # used without pytest: do not run the test
                return None
            pytest.skip(reason)

        return wrapper  # type: ignore[return-value]

    return decorator


def run_on_environment_flag(name: str) -> Any:
    """A pytest mark that runs the test only when the environment variable ``name.upper()`` is
    ``"1"`` and skips it otherwise (unset means ``"0"``), read when the test module is collected.

    Args:
        name: the flag's name, e.g. ``"AUTO_PARALLEL"``.

    Returns:
        A ``pytest.mark.skipif`` mark, used as a decorator.

    Raises:
        TypeError: ``name`` is not a string.
        ImportError: pytest is not installed.

    Example:
        >>> @run_on_environment_flag(name="AUTO_PARALLEL")  # AUTO_PARALLEL=1 pytest ...
        ... def test_solver():
        ...     ...
    """
    if not isinstance(name, str):
        raise TypeError(f"name={name!r} must be the environment variable's name as a str.")
    try:
        import pytest
    except ImportError as exc:
        raise ImportError(
            "run_on_environment_flag returns a pytest mark: install pytest (pip install pytest)."
        ) from exc
    variable = name.upper()
    value = os.environ.get(variable, "0")
    return pytest.mark.skipif(value != "1", reason=f"runs only with {variable}=1 (it is {value!r})")
