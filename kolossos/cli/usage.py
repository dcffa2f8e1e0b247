"""Clearer argparse errors for the ``kolossos`` sub-commands: an unknown option gets the closest
known one, or (for ``kolossos train``) the ``key=value`` spelling of a configuration key."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable

__all__ = ["explain_unknown"]

_PREFIX = "unrecognized arguments: "


def explain_unknown(message: str, parser: argparse.ArgumentParser, keys: Iterable[str] = ()) -> str:
    """``message`` with a suggestion for each unknown option when argparse says
    ``unrecognized arguments: ...``; other messages come back unchanged.

    Args:
        message: argparse's error message.
        parser: the parser that produced it (its option strings are the candidates).
        keys: dotted configuration keys; an unknown ``--steps`` then suggests ``train.steps=``.

    Example:
        >>> p = argparse.ArgumentParser(prog="x")
        >>> _ = p.add_argument("--nproc_per_node")
        >>> explain_unknown("unrecognized arguments: --nproc_per_nod", p)
        "unknown option --nproc_per_nod (did you mean --nproc_per_node?); see 'x --help'."
    """
    if not message.startswith(_PREFIX):
        return message
    flags = [w.split("=", 1)[0] for w in message[len(_PREFIX) :].split() if w.startswith("-")]
    if not flags:
        return message
    options = [
        name
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for name in action.option_strings
    ]
    keys = list(keys)
    by_leaf = {key.rsplit(".", 1)[-1]: key for key in keys}
    parts = []
    for flag in flags:
        leaf = flag.lstrip("-").replace("-", "_")
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
        key = by_leaf.get(leaf) or next(iter(difflib.get_close_matches(leaf, keys, n=1)), None)
        if leaf in by_leaf or (key and not close):
            parts.append(f"{flag} (configuration keys are set as key=value: {key}=...)")
        elif close:
            parts.append(f"{flag} (did you mean {close[0]}?)")
        else:
            parts.append(flag)
    noun = "option" if len(parts) == 1 else "options"
    return f"unknown {noun} {', '.join(parts)}; see '{parser.prog} --help'."
