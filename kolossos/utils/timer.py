"""Wall-clock timers of Colossal-AI's ``colossalai.utils.timer``: :class:`Timer` and a named
set of them, :class:`MultiTimer` (what the legacy ``Trainer(timer=...)`` takes).

Each reading synchronises the accelerator first (a SYNC POINT on CUDA), so a timed interval
covers the device work queued inside it.

Example:
    >>> timer = MultiTimer()
    >>> timer.start("step")
    >>> elapsed = timer.stop("step", keep_in_history=True)
    >>> timer.get_timer("step").has_history
    True
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kolossos.accelerator import get_accelerator

__all__ = ["MultiTimer", "Timer"]


def _now() -> float:
    get_accelerator().synchronize()  # SYNC POINT: count the queued device work
    return time.time()


class Timer:
    """One stopwatch: ``start`` / ``stop`` intervals, optionally kept in a history.

    Example:
        >>> t = Timer()
        >>> t.start()
        >>> t.stop(keep_in_history=True) >= 0.0
        True
        >>> len(t.history)
        1
    """

    def __init__(self) -> None:
        self._started = False
        self._start_time = time.time()
        self._elapsed = 0.0
        self._history: list[float] = []

    @property
    def has_history(self) -> bool:
        """Whether an interval was kept with ``stop(keep_in_history=True)``."""
        return len(self._history) != 0

    @property
    def history(self) -> list[float]:
        """The kept intervals, oldest first (a copy)."""
        return list(self._history)

    @property
    def current_time(self) -> float:
        """The wall-clock time after synchronising the accelerator."""
        return _now()

    def start(self) -> None:
        """Start a new interval (the last elapsed time is cleared)."""
        self._elapsed = 0.0
        self._start_time = _now()
        self._started = True

    def lap(self) -> float:
        """Seconds since :meth:`start`, without stopping."""
        return _now() - self._start_time

    def stop(self, keep_in_history: bool = False) -> float:
        """Stop the interval and return its length in seconds.

        Args:
            keep_in_history: append the interval to the history (for the mean and sum).

        Raises:
            RuntimeError: the timer was not started.
        """
        if not self._started:
            raise RuntimeError("Timer.stop() called before Timer.start(); start the timer first.")
        elapsed = _now() - self._start_time
        if keep_in_history:
            self._history.append(elapsed)
        self._elapsed = elapsed
        self._started = False
        return elapsed

    def get_history_mean(self) -> float:
        """The mean of the kept intervals.

        Raises:
            RuntimeError: nothing was kept yet.
        """
        if not self._history:
            raise RuntimeError(
                "the timer has no history; stop it with keep_in_history=True at least once."
            )
        return sum(self._history) / len(self._history)

    def get_history_sum(self) -> float:
        """The sum of the kept intervals (0 without history)."""
        return sum(self._history)

    def get_elapsed_time(self) -> float:
        """The length of the last stopped interval.

        Raises:
            RuntimeError: the timer is running.
        """
        if self._started:
            raise RuntimeError("the timer is still running; stop it before reading the interval.")
        return self._elapsed

    def reset(self) -> None:
        """Clear the history and stop the timer."""
        self._history = []
        self._started = False
        self._elapsed = 0.0


class MultiTimer:
    """Timers by name, created on first ``start``; all calls are no-ops while switched off.

    Args:
        on: whether the timers run.

    Example:
        >>> timers = MultiTimer()
        >>> timers.start("forward")
        >>> _ = timers.stop("forward", keep_in_history=False)
        >>> [name for name, _ in timers]
        ['forward']
    """

    def __init__(self, on: bool = True) -> None:
        self._on = on
        self._timers: dict[str, Timer] = {}

    def start(self, name: str) -> None:
        """Start the timer ``name`` (created if new)."""
        if self._on:
            self._timers.setdefault(name, Timer()).start()

    def stop(self, name: str, keep_in_history: bool) -> float | None:
        """Stop the timer ``name``; its interval in seconds, or ``None`` while switched off.

        Raises:
            KeyError: no timer ``name`` was started.
        """
        if not self._on:
            return None
        return self.get_timer(name).stop(keep_in_history)

    def get_timer(self, name: str) -> Timer:
        """The timer ``name``.

        Raises:
            KeyError: no timer ``name`` was started.
        """
        if name not in self._timers:
            known = ", ".join(sorted(self._timers)) or "none"
            raise KeyError(f"no timer named {name!r} (started: {known}); call start({name!r}).")
        return self._timers[name]

    def reset(self, name: str | None = None) -> None:
        """Reset the timer ``name``, or every timer when ``name`` is ``None``."""
        if not self._on:
            return
        if name is not None:
            self.get_timer(name).reset()
        else:
            for timer in self._timers.values():
                timer.reset()

    def is_on(self) -> bool:
        """Whether the timers run."""
        return self._on

    def set_status(self, mode: bool) -> None:
        """Switch the timers on (``True``) or off."""
        self._on = mode

    def __iter__(self) -> Iterator[tuple[str, Timer]]:
        yield from self._timers.items()
