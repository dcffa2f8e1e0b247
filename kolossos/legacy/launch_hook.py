"""How ``kolossos.launch*`` fills the global context without the launcher importing it.

``kolossos.initialize`` (layer 0) keeps a list of launch hooks and knows nothing of the legacy
API. Importing this module adds :data:`GLOBAL_CONTEXT_HOOK` to that list; ``kolossos.launch``,
``launch_from_torch``, ``launch_from_slurm`` and ``launch_from_openmpi`` resolve through this
module (``kolossos/__init__.py``), and so does ``kolossos.legacy.core``, so the hook is in place
whenever either is used. The hook

1. before the rendezvous: loads the config into ``gpc.config`` (a file is read once), checks its
   keys and the ``parallel`` rules against the world size — a bad config fails on every rank
   before any collective;
2. after it: builds the process groups of a ``parallel`` key and seeds the per-mode streams, or
   (no ``parallel`` key) records only the world group, without a collective.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from kolossos.initialize import (
    add_launch_hook,
    get_default_parser,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)
from kolossos.legacy.context.parallel_context import global_context

__all__ = [
    "GLOBAL_CONTEXT_HOOK",
    "GlobalContextHook",
    "get_default_parser",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]


class GlobalContextHook:
    """The launch hook of :data:`kolossos.legacy.core.global_context`."""

    def __init__(self) -> None:
        self._forget_at_exit = False

    def check(self, config: dict[str, Any] | Path, world_size: int) -> None:
        """Load ``config`` into ``gpc`` and check it; no process group is needed."""
        global_context.reset()
        global_context.load_config(config)
        global_context.check_parallel(world_size)

    def launched(self, rank: int, world_size: int, seed: int) -> None:
        """Build the groups (COLLECTIVE when the config has ``parallel``) and seed."""
        if global_context.config.get("parallel") is not None:
            global_context.init_parallel_groups()
        else:
            global_context.init_global_groups()
        global_context.set_seed(seed)
        if not self._forget_at_exit:
            # Registered after the launcher's own teardown, so it runs first (atexit is LIFO):
            # the launcher destroys the process groups while nothing else holds them; a group
            # object outliving that into interpreter teardown lets gloo abort the process.
            self._forget_at_exit = True
            atexit.register(global_context.reset)


#: the hook instance ``kolossos.initialize`` calls
GLOBAL_CONTEXT_HOOK = GlobalContextHook()
add_launch_hook(GLOBAL_CONTEXT_HOOK)
