"""The legacy ``Config``: attribute access, ``from_file`` for every format and every error,
reserved keys, UPPER-CASE hyper-parameters and the warnings about unknown keys."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

from kolossos.context import Config as AliasConfig
from kolossos.legacy.context import Config, ConfigException, ParallelContext
from kolossos.legacy.context.reserved_keys import RESERVED_KEYS, check_config_keys

PY_CONFIG = """
import math
BATCH_SIZE = 8
NUM_MICRO_BATCHES = 2
TENSOR_SHAPE = (BATCH_SIZE // NUM_MICRO_BATCHES, 4)
parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
gradient_accumulation = 2
clip_grad_norm = 1.0
class Ignored: ...
__hidden = 1
"""


def test_attribute_access_and_nesting() -> None:
    cfg = Config(dict(parallel=dict(tensor=dict(size=2, mode="1d")), LR=0.1))
    assert cfg.parallel.tensor.size == 2 and isinstance(cfg.parallel, Config)
    assert cfg.LR == 0.1 and hasattr(cfg, "LR") and not hasattr(cfg, "LOG_PATH")
    assert getattr(cfg, "gradient_accumulation", 1) == 1
    cfg.EPOCHS = 3
    assert cfg["EPOCHS"] == 3
    cfg.update(dict(fp16=dict(mode=None)))
    assert isinstance(cfg.fp16, Config)
    with pytest.raises(AttributeError):
        _ = cfg.missing
    with pytest.raises(TypeError, match="needs a dict"):
        Config([1, 2])  # type: ignore[arg-type]
    assert AliasConfig is Config


def test_from_python_file(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    path.write_text(PY_CONFIG)
    cfg = Config.from_file(path)
    assert cfg.BATCH_SIZE == 8 and cfg.TENSOR_SHAPE == (4, 4)
    assert cfg.parallel.tensor.mode == "1d" and cfg.gradient_accumulation == 2
    assert "math" not in cfg and "Ignored" not in cfg and "__hidden" not in cfg
    assert Config.from_file(str(path)) == cfg


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".json", '{"parallel": {"pipeline": 2}, "BATCH_SIZE": 8}'),
        (".toml", "BATCH_SIZE = 8\n[parallel]\npipeline = 2\n"),
        (".yaml", "BATCH_SIZE: 8\nparallel:\n  pipeline: 2\n"),
        (".yml", "BATCH_SIZE: 8\nparallel:\n  pipeline: 2\n"),
    ],
)
def test_from_data_files(tmp_path: Path, suffix: str, text: str) -> None:
    if "yaml" in suffix or "yml" in suffix:
        pytest.importorskip("yaml")
    path = tmp_path / f"config{suffix}"
    path.write_text(text)
    cfg = Config.from_file(path)
    assert cfg.parallel.pipeline == 2 and cfg.BATCH_SIZE == 8


def test_yaml_without_pyyaml_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\n")
    monkeypatch.setitem(__import__("sys").modules, "yaml", None)
    with pytest.raises(ConfigException, match="needs PyYAML; pip install pyyaml"):
        Config.from_file(path)


@pytest.mark.parametrize(
    ("name", "text", "error", "match"),
    [
        ("boom.py", "x = 1 / 0\n", ConfigException, "raised ZeroDivisionError"),
        ("bad.json", "{not json", ConfigException, "not valid JSON"),
        ("bad.toml", "a = = 1", ConfigException, "not valid TOML"),
        ("list.json", "[1, 2]", ConfigException, "must be a table"),
        ("c.txt", "a = 1", ValueError, "suffix '.txt' is not supported"),
    ],
)
def test_file_errors(
    tmp_path: Path, name: str, text: str, error: type[Exception], match: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(error, match=match):
        Config.from_file(path)


def test_missing_file_and_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Config.from_file(tmp_path / "nope.py")
    with pytest.raises(TypeError, match="needs a path"):
        Config.from_file(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dict or the path"):
        ParallelContext().load_config(3)  # type: ignore[arg-type]


def test_every_reserved_key_of_the_checklist_is_understood() -> None:
    documented = {
        "parallel", "fp16", "zero", "gradient_accumulation", "clip_grad_norm",
        "gradient_handler", "gradient_handlers", "dali", "cudnn_benchmark",
        "cudnn_deterministic", "torch_ddp", "model",
    }  # fmt: skip
    assert documented <= set(RESERVED_KEYS)
    good = dict(
        parallel=dict(pipeline=1),
        fp16=dict(mode=None),
        zero=dict(model_config={}),
        gradient_accumulation=4,
        clip_grad_norm=1.0,
        gradient_handler=[dict(type="DataParallelGradientHandler")],
        dali=dict(gpu_aug=True),
        cudnn_benchmark=False,
        cudnn_deterministic=True,
        torch_ddp=dict(find_unused_parameters=True),
        model=dict(num_chunks=2),
        NUM_MICRO_BATCHES=4,
        TENSOR_SHAPE=None,
        LOG_PATH="./logs",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_config_keys(Config(good)) == []


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("gradient_accumulation", "4", TypeError),
        ("gradient_accumulation", 0, ValueError),
        ("gradient_accumulation", True, TypeError),
        ("clip_grad_norm", -1.0, ValueError),
        ("parallel", 4, TypeError),
        ("cudnn_benchmark", 1, TypeError),
        ("gradient_handler", "DataParallelGradientHandler", TypeError),
    ],
)
def test_reserved_keys_with_wrong_types(key: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=key):
        check_config_keys({key: value})


def test_unknown_lower_case_keys_warn_once_each_by_name() -> None:
    cfg = dict(paralel=dict(pipeline=2), batch_size=8, BATCH_SIZE=8, clip_grad_norm=0.0)
    with pytest.warns(UserWarning) as record:
        unknown = check_config_keys(cfg)
    assert unknown == ["paralel", "batch_size"]
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "'paralel'" in messages[0] and "'batch_size'" in messages[1]


def test_upper_case_names_reach_gpc_config(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    path.write_text(PY_CONFIG)
    context = ParallelContext()
    context.load_config(str(path))
    assert context.config.BATCH_SIZE == 8 and context.config.NUM_MICRO_BATCHES == 2
    assert importlib.util.find_spec("kolossos.legacy.context.config") is not None
