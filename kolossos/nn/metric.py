"""Colossal-AI's old import path ``colossalai.nn.metric``: a thin alias of
:mod:`kolossos.legacy.nn.metric`, resolved lazily (``kolossos.nn`` sits below the legacy API, so
importing this module does not load it).

Example:
    >>> from kolossos.nn.metric import Accuracy
    >>> Accuracy.__module__
    'kolossos.legacy.nn.metric.accuracy'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes

if TYPE_CHECKING:
    from kolossos.legacy.nn.metric import (
        Accuracy,
        Accuracy2D,
        Accuracy2p5D,
        Accuracy3D,
        MixupAccuracy,
        calc_acc,
    )

__all__ = ["Accuracy", "Accuracy2D", "Accuracy2p5D", "Accuracy3D", "MixupAccuracy", "calc_acc"]

_LAZY: dict[str, tuple[str, str | None]] = {
    name: ("kolossos.legacy.nn.metric", name) for name in __all__
}

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
