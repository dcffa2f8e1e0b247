"""Pins the signatures and import paths of Colossal-AI's ``colossalai.testing`` helpers (v0.3.x)
that kolossos provides, in the notation of ``test_api_signatures.py``: ``name`` (required),
``name=<repr of default>``, ``*name`` (keyword-only), ``*args`` / ``**kwargs``.

Upstream's parameter names and defaults are what tests written against it use (keywords
included); change a pin only on purpose, with a comment saying how and why it differs.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pin_notation import P, describe

import kolossos.testing as kt
from kolossos.testing.random import seed_all

PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    "clear_cache_before_run": (kt.clear_cache_before_run, P("")),
    "check_state_dict_equal": (
        kt.check_state_dict_equal,
        P("d1 d2 ignore_device=True ignore_dtype=False"),
    ),
    "DummyDataloader.__init__": (kt.DummyDataloader.__init__, P("data_gen_fn length=10")),
    "assert_close_loose": (kt.assert_close_loose, P("a b rtol=0.001 atol=0.001")),
    "assert_equal": (kt.assert_equal, P("a b")),
    "assert_not_equal": (kt.assert_not_equal, P("a b")),
    "assert_equal_in_group": (kt.assert_equal_in_group, P("tensor process_group=None")),
    "assert_hf_output_close": (
        kt.assert_hf_output_close,
        P("out1 out2 ignore_keys=None track_name='' atol=1e-05 rtol=1e-05"),
    ),
    "skip_if_not_enough_gpus": (kt.skip_if_not_enough_gpus, P("min_gpus")),
    "run_on_environment_flag": (kt.run_on_environment_flag, P("name")),
    "seed_all": (seed_all, P("seed cuda_deterministic=False")),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected


def test_assert_close_is_torch_testing_assert_close() -> None:
    # upstream re-exports torch's function; its signature is torch's
    assert kt.assert_close is torch.testing.assert_close


def test_spawn_accepts_upstreams_nprocs_keyword() -> None:
    # upstream: spawn(func, nprocs=1, **kwargs); kolossos keeps spawn(fn, world_size=1, ...)
    # (pinned in test_api_signatures.py) and reads nprocs= from **kwargs
    def work(rank: int, world_size: int, port: int) -> None: ...

    inspect.signature(kt.spawn).bind(work, nprocs=2, extra=1)
    inspect.signature(kt.spawn).bind(work, 2)


#: ``from <module> import <name>`` forms that upstream's own tests and users' tests write
TOP_LEVEL = (
    "assert_close assert_close_loose assert_equal assert_not_equal assert_equal_in_group "
    "check_state_dict_equal assert_hf_output_close DummyDataloader clear_cache_before_run "
    "skip_if_not_enough_gpus run_on_environment_flag parameterize rerun_on_exception "
    "rerun_if_address_is_in_use free_port spawn"
)
IMPORT_PATHS = [f"kolossos.testing.{n}" for n in P(TOP_LEVEL)] + [
    "kolossos.testing.comparison.assert_close",
    "kolossos.testing.comparison.assert_close_loose",
    "kolossos.testing.comparison.assert_equal",
    "kolossos.testing.comparison.assert_not_equal",
    "kolossos.testing.comparison.assert_equal_in_group",
    "kolossos.testing.comparison.check_state_dict_equal",
    "kolossos.testing.comparison.assert_hf_output_close",
    "kolossos.testing.random.seed_all",
    "kolossos.testing.pytest_wrapper.run_on_environment_flag",
    "kolossos.testing.utils.DummyDataloader",
    "kolossos.testing.utils.clear_cache_before_run",
    "kolossos.testing.utils.free_port",
    "kolossos.testing.utils.parameterize",
    "kolossos.testing.utils.rerun_if_address_is_in_use",
    "kolossos.testing.utils.rerun_on_exception",
    "kolossos.testing.utils.skip_if_not_enough_gpus",
    "kolossos.testing.utils.spawn",
]


def resolve(dotted: str) -> Any:
    """Import ``module.name`` the way ``from module import name`` does."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("dotted", IMPORT_PATHS)
def test_import_path_resolves_to_the_one_object(dotted: str) -> None:
    obj = resolve(dotted)
    assert callable(obj)
    name = dotted.rpartition(".")[2]
    if hasattr(kt, name):
        assert obj is getattr(kt, name)


def test_every_upstream_testing_name_is_exported() -> None:
    upstream_all = {
        "assert_equal",
        "assert_not_equal",
        "assert_close",
        "assert_close_loose",
        "assert_equal_in_group",
        "parameterize",
        "rerun_on_exception",
        "rerun_if_address_is_in_use",
        "skip_if_not_enough_gpus",
        "free_port",
        "spawn",
        "clear_cache_before_run",
        "run_on_environment_flag",
        "check_state_dict_equal",
        "assert_hf_output_close",
        "DummyDataloader",
    }
    assert upstream_all <= set(kt.__all__)
