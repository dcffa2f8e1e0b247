"""Multi-process test harness: :func:`spawn`, the pytest decorator :func:`distributed`, parameter
sweeps and reruns; :func:`assert_moved` for parity tests (trained parameters moved well beyond the
parity tolerance).

Example:
    >>> from kolossos.testing import spawn
    >>> def run(rank, world_size, port):
    ...     kolossos.launch({}, rank, world_size, host="localhost", port=port)
    >>> spawn(run, 2)  # doctest: +SKIP
"""

from kolossos.testing.decorators import parameterize, rerun_if_address_is_in_use, rerun_on_exception
from kolossos.testing.distributed import distributed
from kolossos.testing.network import free_port
from kolossos.testing.parity import assert_moved, snapshot
from kolossos.testing.spawn import RankError, spawn

__all__ = [
    "RankError",
    "assert_moved",
    "distributed",
    "free_port",
    "parameterize",
    "rerun_if_address_is_in_use",
    "rerun_on_exception",
    "snapshot",
    "spawn",
]
