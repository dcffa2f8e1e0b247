"""The live progress line of rank 0: steps, loss, tokens/s, memory per rank, time left.

On a terminal the line is redrawn in place after every step; otherwise (a pipe, a log file, CI)
a full line is printed every ``log_interval`` steps. Messages (evaluations, checkpoints) are
printed above the line.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_bytes", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``'1:15'``; hours when needed (``'1:02:03'``)."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_bytes(count: float) -> str:
    """``412_000_000`` -> ``'393M'`` (binary units)."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(count) < 1024 or unit == "T":
            return f"{count:.0f}{unit}" if unit in "BKM" else f"{count:.1f}{unit}"
        count /= 1024
    return f"{count:.1f}T"  # pragma: no cover


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f}"


class ProgressBar:
    """Draws the progress of steps ``start+1 .. total``.

    Args:
        total: the last step.
        start: steps already done (resumed runs).
        log_interval: steps between lines when the stream is not a terminal.
        stream: where to draw (default stdout); ``live`` forces (or disables) in-place redraws.
        width: characters of the bar itself.
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        log_interval: int = 10,
        stream: TextIO | None = None,
        live: bool | None = None,
        width: int = 24,
    ) -> None:
        self.total = total
        self.start = start
        self.log_interval = log_interval
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.width = width
        self.t0 = time.monotonic()
        self.val_loss: float | None = None
        self.mem: list[float] = []
        self._last = ""

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        """The text of the progress line after ``step``."""
        frac = step / self.total if self.total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.t0
        done = step - self.start
        left = elapsed / done * (self.total - step) if done > 0 else 0.0
        parts = [
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {frac:4.0%}",
            f"loss {loss:.4f}",
        ]
        if self.val_loss is not None:
            parts.append(f"val {self.val_loss:.4f}")
        parts.append(f"{_rate(tokens_per_s)} tok/s")
        if self.mem:
            parts.append("mem " + " ".join(format_bytes(m) for m in self.mem))
        parts.append(f"{format_duration(elapsed)}<{format_duration(left)}")
        return " | ".join(parts)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Show the state after ``step``."""
        text = self.line(step, loss, tokens_per_s)
        if self.live:
            # a line longer than the terminal wraps, and "\r" would then redraw only its tail
            text = text[: shutil.get_terminal_size((120, 24)).columns - 1]
            pad = " " * max(0, len(self._last) - len(text))
            self.stream.write("\r" + text + pad)
            self.stream.flush()
            self._last = text
        elif step % self.log_interval == 0 or step == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """Print ``text`` on its own line (above the live line, which is redrawn next update)."""
        if self.live and self._last:
            self.stream.write("\r" + " " * len(self._last) + "\r")
            self._last = ""
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the live line."""
        if self.live and self._last:
            self.stream.write("\n")
            self.stream.flush()
            self._last = ""
