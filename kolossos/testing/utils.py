"""The import path ``colossalai.testing.utils``: the same objects as :mod:`kolossos.testing`."""

from kolossos.testing.dataloader import DummyDataloader
from kolossos.testing.decorators import (
    clear_cache_before_run,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
    skip_if_not_enough_gpus,
)
from kolossos.testing.network import free_port
from kolossos.testing.spawn import spawn

__all__ = [
    "DummyDataloader",
    "clear_cache_before_run",
    "free_port",
    "parameterize",
    "rerun_if_address_is_in_use",
    "rerun_on_exception",
    "skip_if_not_enough_gpus",
    "spawn",
]
