"""``conditional_context``: enter a context manager only when a flag says so."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["conditional_context"]


@contextlib.contextmanager
def conditional_context(
    context_manager: AbstractContextManager[Any], enable: bool = True
) -> Iterator[None]:
    """Run the body inside ``context_manager`` if ``enable``, else without it.

    The usual use is a gradient-accumulation step that must skip communication except on the
    last micro-batch: ``with conditional_context(booster.no_sync(model, optimizer),
    enable=not last): ...``. The context manager is not entered at all when ``enable`` is
    false (an already-built generator context is then simply never started).

    Args:
        context_manager: the context manager to enter (e.g. ``model.no_sync()``).
        enable: whether to enter it (any truth value, as in Colossal-AI).

    Example:
        >>> with conditional_context(torch.no_grad(), enable=False):
        ...     y = x * 2  # doctest: +SKIP
    """
    if enable:
        with context_manager:
            yield
    else:
        yield
