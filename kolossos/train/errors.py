"""``ConfigError``: one-paragraph messages that name the key, the bad value and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = ["ConfigError", "did_you_mean"]

_MISSING = object()


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (``None`` when nothing is close enough).

    Compares whole dotted keys and their last parts, so ``steps`` suggests ``train.steps`` and
    ``model.n_layers`` suggests ``model.n_layer``.

    Example:
        >>> did_you_mean("model.n_layers", ["model.n_layer", "model.n_head"])
        'model.n_layer'
    """
    options = list(dict.fromkeys(candidates))
    best = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if best:
        return best[0]
    leaf = word.rsplit(".", 1)[-1]
    by_leaf: dict[str, str] = {}
    for option in options:
        by_leaf.setdefault(option.rsplit(".", 1)[-1], option)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class ConfigError(ValueError):
    """A training configuration that cannot run, explained in one paragraph.

    Attributes:
        key: the dotted config key at fault (``"train.batch_size"``), or ``""`` for the file.
        source: where the value came from (a file, ``"command line"``), or ``""``.
    """

    def __init__(
        self,
        key: str,
        value: Any = _MISSING,
        allowed: str = "",
        *,
        problem: str = "",
        hint: str = "",
        source: str = "",
    ) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.problem = problem
        self.hint = hint
        self.source = source
        super().__init__(self._render())

    @classmethod
    def unknown_key(
        cls,
        key: str,
        known: Iterable[str],
        *,
        section: str = "",
        source: str = "",
        everywhere: Iterable[str] = (),
    ) -> ConfigError:
        """The error for a key the schema does not have, with a "did you mean" suggestion.

        Args:
            key: the full dotted key that was given.
            known: the valid keys of ``section`` (listed in the message, without the section).
            section: the dotted section the keys belong to (``""`` for the top level).
            source: where the key came from.
            everywhere: every valid dotted key (searched for the suggestion as well).
        """
        where = f"{section}." if section else ""
        known = [f"{where}{name}" for name in known]
        guess = did_you_mean(key, [*known, *everywhere])
        hint = f" Did you mean '{guess}'?" if guess else ""
        return cls(
            key,
            problem=f"'{key}' is not a configuration key.{hint} "
            f"Known keys{' of ' + section if section else ''}: {', '.join(known)}.",
            source=source,
        )

    def prefixed(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` in front of the key (for errors raised by a section,
        which knows only its own field names; ``problem`` texts are written with full keys)."""
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ConfigError(
            key, self.value, self.allowed, problem=self.problem, hint=self.hint, source=self.source
        )

    def with_source(self, source: str) -> ConfigError:
        """The same error, saying where the value came from (when not said already)."""
        if self.source:
            return self
        return ConfigError(
            self.key, self.value, self.allowed, problem=self.problem, hint=self.hint, source=source
        )

    def _render(self) -> str:
        if self.problem:
            text = self.problem
        else:
            shown = "" if self.value is _MISSING else f" = {_show(self.value)}"
            text = f"{self.key}{shown} is not allowed"
            if self.allowed:
                text += f": allowed values are {self.allowed}."
            else:
                text += "."
        if self.hint:
            text += f" {self.hint}"
        if self.source:
            text += f" (from {self.source})"
        return " ".join(text.split())
