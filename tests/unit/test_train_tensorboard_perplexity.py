"""``kolossos train``'s extra outputs: TensorBoard scalars (``metrics.tensorboard``), refused
before launch without the package; perplexity in the summary; and the hybrid tp x pp example
config validating for 4 processes."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kolossos.train import ConfigError, load_config
from kolossos.train.metrics import MetricsLog
from kolossos.train.plugins import check_layout
from kolossos.train.prelaunch import check_config, check_dependencies
from kolossos.train.report import perplexity
from kolossos.train.schema import config_from_dict, config_to_dict

REPO = Path(__file__).resolve().parents[2]
HYBRID = REPO / "examples" / "configs" / "gpt_hybrid_tp2_pp2.py"


class RecordingWriter:
    """Keeps what :class:`MetricsLog` hands a TensorBoard writer."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.flushes = 0

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.scalars.append((tag, scalar_value, global_step))

    def flush(self) -> None:
        self.flushes += 1


def test_metrics_tensorboard_key_is_a_checked_bool() -> None:
    assert load_config(None).metrics.tensorboard is False
    config = load_config(None, ["metrics.tensorboard=true"])
    assert config.metrics.tensorboard is True
    assert config_from_dict(config_to_dict(config)) == config
    with pytest.raises(ConfigError, match=r"metrics\.tensorboard.*true or false"):
        load_config(None, ["metrics.tensorboard=2"])


def test_tensorboard_without_the_package_is_refused_before_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "tensorboard" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    check_dependencies(load_config(None))  # off by default: nothing needed
    with pytest.raises(ConfigError) as info:
        check_dependencies(load_config(None, ["metrics.tensorboard=true"]))
    text = str(info.value)
    assert "metrics.tensorboard" in text and "pip install tensorboard" in text, text
    assert "\n" not in text


def test_every_number_of_every_record_becomes_a_scalar(tmp_path: Path) -> None:
    writer = RecordingWriter()
    log = MetricsLog(tmp_path / "metrics.jsonl", scalars=writer)
    log.write({"kind": "val", "step": 0, "val_loss": 4.25})
    train = {"kind": "train", "step": 3, "loss": 2.5, "lr": 0.001, "mem_bytes": [10, 20]}
    log.write(train)
    assert writer.scalars == [
        ("val/val_loss", 4.25, 0),
        ("train/loss", 2.5, 3),
        ("train/lr", 0.001, 3),
        ("train/mem_bytes/rank0", 10.0, 3),
        ("train/mem_bytes/rank1", 20.0, 3),
    ]
    assert writer.flushes == 2  # every record reaches the event file at once
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines][-1] == train  # the file is unchanged


def test_tensorboard_writer_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from kolossos.train.metrics import tensorboard_writer

    log = MetricsLog(tmp_path / "metrics.jsonl", scalars=tensorboard_writer(tmp_path / "tb"))
    log.write({"kind": "val", "step": 0, "val_loss": 4.25})
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_perplexity_is_exp_of_the_loss() -> None:
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(76)) == pytest.approx(76)
    assert perplexity(2.0) == pytest.approx(math.e**2)
    assert perplexity(1e4) == math.inf  # a diverged run reports inf, not an OverflowError


def test_hybrid_example_is_tp2_by_pp2_on_4_processes() -> None:
    config = load_config(HYBRID)
    assert config.nproc_per_node == 4 and config.plugin == "hybrid_parallel"
    assert (config.plugin_kwargs["tp_size"], config.plugin_kwargs["pp_size"]) == (2, 2)
    check_config(config, 4)  # plugin, keywords, layout, heads per tp rank, blocks per stage
    assert check_layout(config, 4).dp_size == 1
    with pytest.raises(ConfigError, match=r"tp_size=2 x pp_size=2 = 4 processes"):
        check_config(config, 2)  # tp x pp = 4 does not fit 2 processes
