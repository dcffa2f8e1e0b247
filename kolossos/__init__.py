"""kolossos: large-scale parallel training of PyTorch models.

The top-level names are resolved lazily, so ``import kolossos`` (and the ``kolossos`` command line)
stays fast and has no side effects; ``torch`` is imported on first use of one of them.

Example:
    >>> import kolossos
    >>> kolossos.launch_from_torch(config={})  # doctest: +SKIP
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from kolossos._lazy import lazy_attributes
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
    from kolossos.legacy.initialize import initialize

# The launch functions are kolossos.initialize's, re-exported by kolossos.legacy.launch_hook so
# that the legacy global context (gpc) is filled by every kolossos.launch* (docs/legacy.md).
_INITIALIZE = "kolossos.legacy.launch_hook"
_LAZY = {
    "launch": (_INITIALIZE, "launch"),
    "launch_from_torch": (_INITIALIZE, "launch_from_torch"),
    "launch_from_slurm": (_INITIALIZE, "launch_from_slurm"),
    "launch_from_openmpi": (_INITIALIZE, "launch_from_openmpi"),
    "get_default_parser": (_INITIALIZE, "get_default_parser"),
    "Booster": ("kolossos.booster", "Booster"),
    # Colossal-AI's colossalai.initialize(model, optimizer, ...) -> (engine, ...); the launcher
    # module kolossos/initialize.py keeps its import path (see _Package)
    "initialize": ("kolossos.legacy.initialize", "initialize"),
}

__all__ = [
    "Booster",
    "__version__",
    "get_default_parser",
    "initialize",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)


class _Package(types.ModuleType):
    """The type of the ``kolossos`` module: ``kolossos.initialize`` is the legacy *function*
    (as ``colossalai.initialize`` is), although ``kolossos/initialize.py`` is the launcher
    *module*. Importing a submodule makes Python bind it as an attribute of its package, which
    would hide the function; this type declines that one binding, so the attribute always
    resolves through the lazy table, while ``from kolossos.initialize import launch`` and
    ``importlib.import_module("kolossos.initialize")`` still reach the module (``sys.modules``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "initialize" and isinstance(value, types.ModuleType):
            return  # the launcher submodule being bound by the import system
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
