"""A pytest-native way to write a multi-process test: the body runs on every rank with the default
process group already initialised by :func:`kolossos.launch`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from kolossos.testing.spawn import spawn


def _rank_body(
    rank: int,
    world_size: int,
    port: int,
    test_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str | None,
    seed: int,
) -> None:
    import kolossos

    kolossos.launch(
        config={},
        rank=rank,
        world_size=world_size,
        host="127.0.0.1",
        port=port,
        backend=backend,
        seed=seed,
        verbose=False,
    )
    test_fn(*args, **kwargs)


def distributed(
    world_size: int | None = None,
    *,
    timeout: float | None = None,
    backend: str | None = "gloo",
    seed: int = 1024,
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Run the decorated pytest test on ``world_size`` forked ranks.

    Each rank calls ``kolossos.launch`` (gloo by default, the same seed on all ranks), then the
    test body with the same arguments pytest resolved (fixtures and ``parametrize`` values work as
    usual). When ``world_size`` is ``None`` the test must take a ``world_size`` argument, e.g. from
    ``@pytest.mark.parametrize("world_size", [2, 4])``. A failing rank fails the test with that
    rank's number and traceback; a hang fails it after ``timeout`` seconds with every rank's stack.

    Example:
        >>> @distributed(2)
        ... def test_all_reduce():
        ...     t = torch.ones(1)
        ...     torch.distributed.all_reduce(t)
        ...     assert t.item() == 2
    """

    def decorator(test_fn: Callable[..., Any]) -> Callable[..., None]:
        signature = inspect.signature(test_fn)
        if world_size is None and "world_size" not in signature.parameters:
            raise TypeError(
                f"{test_fn.__name__}: @distributed() without a world size needs a 'world_size' "
                "argument (e.g. from pytest.mark.parametrize)."
            )

        @functools.wraps(test_fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            size = world_size if world_size is not None else kwargs["world_size"]
            spawn(
                _rank_body,
                size,
                timeout=timeout,
                test_fn=test_fn,
                args=args,
                kwargs=kwargs,
                backend=backend,
                seed=seed,
            )

        try:
            import pytest
        except ImportError:  # usable without pytest, as a plain decorator
            return wrapper
        marked: Callable[..., None] = pytest.mark.dist(wrapper)
        return marked

    return decorator
