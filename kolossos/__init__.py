"""kolossos: large-scale parallel training of PyTorch models.

The top-level names are resolved lazily, so ``import kolossos`` (and the ``kolossos`` command line)
stays fast and has no side effects; ``torch`` is imported on first use of one of them.

Example:
    >>> import kolossos
    >>> kolossos.launch_from_torch(config={})  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
