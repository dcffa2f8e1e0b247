"""Errors raised by checkpoint IO: a bad file, a missing checkpoint, a state that does not fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "LoadReport",
]


class CheckpointError(RuntimeError):
    """A checkpoint file or directory cannot be read or written.

    The message names the file and says what is wrong with it (corrupt, truncated, not a
    checkpoint, written by a newer version...).
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given path."""


@dataclass(frozen=True)
class LoadReport:
    """What a load did not apply: the result of ``load_model`` and ``load_optimizer``.

    Attributes:
        missing_keys: entries the target expects but the checkpoint lacks.
        unexpected_keys: entries in the checkpoint the target does not have.
        mismatched_keys: ``(name, shape in checkpoint, shape in target)`` for entries whose shapes
            differ.
    """

    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    mismatched_keys: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = field(
        default_factory=tuple
    )

    @property
    def ok(self) -> bool:
        """Whether everything in the checkpoint matched the target exactly."""
        return not (self.missing_keys or self.unexpected_keys or self.mismatched_keys)

    def describe(self, limit: int = 50) -> str:
        """Return a human-readable list of every problem (at most ``limit`` names per kind)."""
        parts = []
        for title, names in (
            ("missing", list(self.missing_keys)),
            ("unexpected", list(self.unexpected_keys)),
            (
                "wrongly shaped (name: checkpoint shape vs target shape)",
                [f"{n}: {list(a)} vs {list(b)}" for n, a, b in self.mismatched_keys],
            ),
        ):
            if names:
                shown = ", ".join(names[:limit])
                more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
                parts.append(f"{len(names)} {title}: {shown}{more}")
        return "; ".join(parts) if parts else "no differences"


class CheckpointMismatchError(CheckpointError):
    """A strict load found missing, unexpected or wrongly shaped entries; nothing was loaded.

    Attributes:
        report: the full :class:`LoadReport`.
        path: the checkpoint that was being loaded.
    """

    def __init__(self, what: str, path: str | Path, report: LoadReport) -> None:
        self.report = report
        self.path = Path(path)
        super().__init__(
            f"{what} checkpoint {str(path)!r} does not match the target, nothing was loaded. "
            f"{report.describe()}. Fix the model/optimizer definition, or pass strict=False to "
            "load only the matching entries."
        )
