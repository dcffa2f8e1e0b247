"""Multi-process test harness: :func:`spawn`, the pytest decorator :func:`distributed`, parameter
sweeps and reruns; :func:`assert_moved` for parity tests (trained parameters moved well beyond the
parity tolerance); and Colossal-AI's ``colossalai.testing`` helpers under the same names
(comparisons, :class:`DummyDataloader`, :func:`clear_cache_before_run`,
:func:`skip_if_not_enough_gpus`, :func:`run_on_environment_flag`; ``seed_all`` lives in
:mod:`kolossos.testing.random`, as upstream).

Example:
    >>> from kolossos.testing import spawn
    >>> def run(rank, world_size, port):
    ...     kolossos.launch({}, rank, world_size, host="localhost", port=port)
    >>> spawn(run, 2)  # doctest: +SKIP
"""

from kolossos.testing.comparison import (
    assert_close,
    assert_close_loose,
    assert_equal,
    assert_equal_in_group,
    assert_hf_output_close,
    assert_not_equal,
    check_state_dict_equal,
)
from kolossos.testing.dataloader import DummyDataloader
from kolossos.testing.decorators import (
    clear_cache_before_run,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
    run_on_environment_flag,
    skip_if_not_enough_gpus,
)
from kolossos.testing.distributed import distributed
from kolossos.testing.network import free_port
from kolossos.testing.parity import assert_moved, snapshot
from kolossos.testing.spawn import RankError, spawn

__all__ = [
    "DummyDataloader",
    "RankError",
    "assert_close",
    "assert_close_loose",
    "assert_equal",
    "assert_equal_in_group",
    "assert_hf_output_close",
    "assert_moved",
    "assert_not_equal",
    "check_state_dict_equal",
    "clear_cache_before_run",
    "distributed",
    "free_port",
    "parameterize",
    "rerun_if_address_is_in_use",
    "rerun_on_exception",
    "run_on_environment_flag",
    "skip_if_not_enough_gpus",
    "snapshot",
    "spawn",
]
