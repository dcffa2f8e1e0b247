"""The trainer's progress display: a ``tqdm`` bar when tqdm is installed, else plain lines on
stderr; nothing when switched off."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["PlainProgress", "Progress", "SilentProgress", "make_progress"]


class Progress(Protocol):
    """What the trainer needs of a progress display: iterate over the step indexes, show the
    latest step metrics, close."""

    def __iter__(self) -> Iterator[int]: ...

    def set_postfix(self, **values: Any) -> None: ...

    def close(self) -> None: ...


class SilentProgress:
    """The step indexes, with nothing displayed.

    Example:
        >>> list(SilentProgress(3))
        [0, 1, 2]
    """

    def __init__(self, total: int) -> None:
        self.total = total

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.total))

    def set_postfix(self, **values: Any) -> None:
        """Show nothing."""

    def close(self) -> None:
        """Nothing to close."""


class PlainProgress(SilentProgress):
    """Without tqdm: one line on stderr about every tenth of the steps and at the end, as
    ``[Epoch 0 / Train]: 5/10 loss=0.31``.

    Example:
        >>> for _ in PlainProgress(2, "[Train]"):
        ...     pass
    """

    def __init__(self, total: int, desc: str) -> None:
        super().__init__(total)
        self.desc = desc
        self._postfix = ""
        self._every = max(1, total // 10)

    def __iter__(self) -> Iterator[int]:
        for i in range(self.total):
            yield i
            done = i + 1
            if done == self.total or done % self._every == 0:
                line = f"{self.desc}: {done}/{self.total}"
                print(f"{line} {self._postfix}".rstrip(), file=sys.stderr, flush=True)

    def set_postfix(self, **values: Any) -> None:
        """Show ``values`` on the following lines."""
        self._postfix = " ".join(f"{k}={v}" for k, v in values.items())


def make_progress(total: int, desc: str, enabled: bool) -> Progress:
    """A display over ``range(total)``: tqdm's bar (if installed) or :class:`PlainProgress`
    when ``enabled``, else :class:`SilentProgress`.

    Example:
        >>> bar = make_progress(10, "[Epoch 0 / Train]", enabled=False)
    """
    if not enabled:
        return SilentProgress(total)
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, desc)
    bar: Progress = tqdm(range(total), desc=desc)
    return bar
