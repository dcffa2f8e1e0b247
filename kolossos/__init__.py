"""kolossos: large-scale parallel training of PyTorch models.

The top-level names are resolved lazily, so ``import kolossos`` (and the ``kolossos`` command line)
stays fast and has no side effects; ``torch`` is imported on first use of one of them.

Example:
    >>> import kolossos
    >>> kolossos.launch_from_torch(config={})  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kolossos._version import __version__

if TYPE_CHECKING:
    from kolossos.booster import Booster
    from kolossos.initialize import (
        get_default_parser,
        launch,
        launch_from_openmpi,
        launch_from_slurm,
        launch_from_torch,
    )

_LAZY: dict[str, str] = {
    "launch": "kolossos.initialize",
    "launch_from_torch": "kolossos.initialize",
    "launch_from_slurm": "kolossos.initialize",
    "launch_from_openmpi": "kolossos.initialize",
    "get_default_parser": "kolossos.initialize",
    "Booster": "kolossos.booster",
}

__all__ = [
    "Booster",
    "__version__",
    "get_default_parser",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kolossos' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
