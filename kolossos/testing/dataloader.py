"""A fake data loader for tests, with Colossal-AI's ``DummyDataloader`` signature."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DummyDataloader"]


class DummyDataloader:
    """Yields ``data_gen_fn()`` ``length`` times per pass; ``len()`` is ``length``.

    ``iter(loader)`` starts a new pass and returns the loader itself, so ``next(loader)`` also
    works (as upstream's does); a ``for`` loop over it runs a full pass each time.

    Args:
        data_gen_fn: called with no arguments for each batch (e.g. returns a dict of tensors).
        length: batches per pass (``>= 0``).

    Raises:
        ValueError: ``length`` is not a non-negative integer.
        TypeError: ``data_gen_fn`` is not callable.

    Example:
        >>> loader = DummyDataloader(lambda: {"x": torch.randn(4, 8)}, length=3)
        >>> len(loader), sum(1 for _ in loader)
        (3, 3)
    """

    def __init__(self, data_gen_fn: Callable[[], Any], length: int = 10) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length={length!r} must be a non-negative integer (batches).")
        if not callable(data_gen_fn):
            raise TypeError(f"data_gen_fn={data_gen_fn!r} must be callable with no arguments.")
        self.data_gen_fn = data_gen_fn
        self.length = length
        self.step = 0

    def __iter__(self) -> DummyDataloader:
        self.step = 0
        return self

    def __next__(self) -> Any:
        if self.step >= self.length:
            raise StopIteration
        self.step += 1
        return self.data_gen_fn()

    def __len__(self) -> int:
        return self.length
