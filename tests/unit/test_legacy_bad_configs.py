"""Malformed legacy configs fail with a clear error before any collective.

Every case goes through ``kolossos.launch`` (as a user's script does) with the rendezvous and
group creation replaced by a function that fails the test: the error must come from the config
checks, on every rank alike, before a process would wait for the others. Each message must name
the offending value, the rule and a fix. The rules themselves are unit-tested next to their code
(``test_legacy_parallel_rules.py``, ``test_legacy_config.py``, ``test_legacy_engine_config.py``);
this file covers the end-to-end path and the cases those leave out.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import kolossos
from kolossos.context import ConfigException
from kolossos.core import global_context as gpc
from kolossos.legacy.engine.config import EngineConfig, EngineConfigError


@pytest.fixture
def no_rendezvous(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if launch reaches the rendezvous or creates a group; reset ``gpc`` after."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("launch reached a collective before rejecting the config")

    for name in ("init_process_group", "new_group", "broadcast", "all_reduce", "barrier"):
        monkeypatch.setattr(dist, name, refuse)
    yield
    gpc.reset()


def _launch(config: Any, world_size: int = 4) -> None:
    kolossos.launch(
        config=config, rank=0, world_size=world_size, host="127.0.0.1", port=29999, verbose=False
    )


# (config, world size, error, message pattern: the value, the rule and the fix)
PARALLEL_RULES: dict[str, tuple[dict[str, Any], int, str]] = {
    "tensor_without_mode": (dict(tensor=4), 4, r"tensor=4 has no mode.*dict\(size=4, mode=...\)"),
    "tensor_dict_without_mode": (
        dict(tensor=dict(size=4)),
        4,
        r"tensor={'size': 4} has no mode; add mode=",
    ),
    "2d_not_square": (dict(tensor=dict(size=8, mode="2d")), 8, r"square size.*8"),
    "2p5d_not_q2_d": (dict(tensor=dict(size=8, mode="2.5d", depth=4)), 8, r"q\*q\*depth; size=8"),
    "2p5d_without_depth": (dict(tensor=dict(size=8, mode="2.5d")), 8, "needs depth=d"),
    "3d_not_cube": (dict(tensor=dict(size=4, mode="3d")), 4, r"cube size.*4"),
    "sizes_not_dividing": (dict(pipeline=3), 4, r"pipeline \(3\).*does not divide the world"),
    "tp_larger_than_world": (dict(tensor=dict(size=4, mode="1d")), 2, r"\(4\).*world size 2"),
    "data_contradicts": (dict(data=4, pipeline=2), 4, "data size is inferred"),
    "unknown_mode": (dict(tensor=dict(size=4, mode="4d")), 4, r"mode='4d' is unknown.*use one of"),
    "mode_not_a_string": (dict(tensor=dict(size=2, mode=1)), 2, r"mode=1 is unknown.*use one of"),
    "size_is_a_string": (
        dict(tensor=dict(size="2", mode="1d")),
        2,
        r"tensor size '2' must be a positive int.*tensor=dict\(size=N\)",
    ),
    "size_is_a_float": (dict(data=2.0), 2, r"data size 2\.0 must be a positive int"),
    "size_negative": (dict(tensor=dict(size=-2, mode="1d")), 2, r"size -2 must be a positive"),
}


@pytest.mark.parametrize("case", list(PARALLEL_RULES))
def test_parallel_rules_fail_in_launch(case: str, no_rendezvous: None) -> None:
    parallel, world, match = PARALLEL_RULES[case]
    with pytest.raises(ValueError, match=match):
        _launch(dict(parallel=parallel), world)
    assert not dist.is_initialized()


WRONG_TYPES: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "parallel_int": (dict(parallel=3), TypeError, r"parallel=3 must be a dict.*dict\(data"),
    "fp16_str": (dict(fp16="yes"), TypeError, r"fp16='yes' must be a dict.*dict\(mode=AMP_TYPE"),
    "accumulation_float": (dict(gradient_accumulation=1.5), TypeError, r"=1\.5 must be a.*int"),
    "clip_str": (dict(clip_grad_norm="x"), TypeError, r"clip_grad_norm='x' must be a.*float"),
    "clip_bool": (dict(clip_grad_norm=True), TypeError, r"clip_grad_norm=True must be"),
    "handler_dict": (
        dict(gradient_handler=dict(type="DataParallelGradientHandler")),
        TypeError,
        r"gradient_handler=\{'type': 'DataParallelGradientHandler'\} must be a list.*\[dict\(type=",
    ),
    "handlers_dict": (
        dict(gradient_handlers=dict(type="DataParallelGradientHandler")),
        TypeError,
        r"gradient_handlers=.* must be a list",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrong_types_fail_in_launch(case: str, no_rendezvous: None) -> None:
    config, error, match = WRONG_TYPES[case]
    with pytest.raises(error, match=match):
        _launch(config)
    assert not dist.is_initialized()


FILES: dict[str, tuple[str, type[Exception], str]] = {
    "raises": ("x = 1 / 0\n", ConfigException, r"bad\.py' raised ZeroDivisionError.*fix the file"),
    "syntax_error": (
        "parallel = dict(tensor=dict(size=2, mode='1d')\n",
        ConfigException,
        r"bad\.py' raised SyntaxError.*line 1.*fix the file",
    ),
    "imports_missing_module": (
        "import kolossos_no_such_module\n",
        ConfigException,
        r"raised ModuleNotFoundError.*kolossos_no_such_module",
    ),
    "broken_rule_in_file": ("parallel = dict(tensor=4)\n", ValueError, "tensor=4 has no mode"),
    "wrong_type_in_file": ("gradient_accumulation = '4'\n", TypeError, "gradient_accumulation"),
}


@pytest.mark.parametrize("case", list(FILES))
def test_bad_config_files_fail_in_launch(case: str, tmp_path: Path, no_rendezvous: None) -> None:
    text, error, match = FILES[case]
    path = tmp_path / "bad.py"
    path.write_text(text)
    with pytest.raises(error, match=match):
        _launch(str(path))
    assert not dist.is_initialized()


def test_missing_config_file_fails_in_launch(tmp_path: Path, no_rendezvous: None) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match=rf"{missing.name}' does not exist; pass an"):
        _launch(str(missing))
    assert not dist.is_initialized()


def test_missing_config_file_message_shows_an_empty_dict(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        _launch(str(tmp_path / "nope.py"))
    assert "{{}}" not in str(info.value)


# Keys whose structure launch accepts; initialize rejects them (before its own collectives),
# because a handler may be registered between launch and initialize.
ENGINE_LEVEL: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "handler_entry_str": (
        dict(gradient_handler=["DataParallelGradientHandler"]),
        EngineConfigError,
        r"entry 'DataParallelGradientHandler' must be a dict with a 'type'.*dict\(type=",
    ),
    "fp16_mode_unknown": (
        dict(fp16=dict(mode="yes")),
        ValueError,
        r"fp16 mode='yes' is not an AMP mode; use one of AMP_TYPE",
    ),
}


@pytest.mark.parametrize("case", list(ENGINE_LEVEL))
def test_engine_level_errors_are_clear(case: str) -> None:
    config, error, match = ENGINE_LEVEL[case]
    with pytest.raises(error, match=match):
        EngineConfig.from_config(config)


@pytest.mark.parametrize(
    ("config", "match"),
    [(dict(fp16="yes"), r"fp16='yes' must be a dict"), (dict(clip_grad_norm="x"), "clip_grad")],
)
def test_engine_config_alone_names_the_key(config: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        EngineConfig.from_config(config)
