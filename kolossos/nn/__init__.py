"""``kolossos.nn``: optimizers and learning-rate schedulers under Colossal-AI's names.

Names resolve lazily (nothing heavy is imported with the package)::

    from kolossos.nn import Lamb, HybridAdam          # as colossalai.nn
    from kolossos.nn.optimizer import CPUAdam         # as colossalai.nn.optimizer
    from kolossos.nn.lr_scheduler import LinearWarmupLR

Example:
    >>> import kolossos.nn as knn
    >>> knn.Lamb.__name__
    'Lamb'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kolossos.nn import lr_scheduler, optimizer
    from kolossos.nn.optimizer import CPUAdam, FusedAdam, HybridAdam, Lamb, Lars

_OPTIMIZERS = ("CPUAdam", "FusedAdam", "HybridAdam", "Lamb", "Lars")
_SUBMODULES = ("lr_scheduler", "optimizer")

__all__ = ["CPUAdam", "FusedAdam", "HybridAdam", "Lamb", "Lars", "lr_scheduler", "optimizer"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"kolossos.nn.{name}")
    elif name in _OPTIMIZERS:
        value = getattr(importlib.import_module("kolossos.nn.optimizer"), name)
    else:
        raise AttributeError(f"module 'kolossos.nn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
