"""``kolossos train`` configuration: files, overrides, validation messages, layout checks; plus the
trainer's other pure logic (batches, tokenizer, schedule, progress line, PNG fallback)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kolossos.booster.plugin import Plugin
from kolossos.cli import train as train_cli
from kolossos.train import ConfigError, TrainConfig, load_config
from kolossos.train.config_files import apply_overrides, parse_override
from kolossos.train.data import CharTokenizer, Corpus
from kolossos.train.errors import did_you_mean
from kolossos.train.paths import STATE_FILE, RunPaths, checkpoint_name
from kolossos.train.plugins import build_plugin, check_layout, check_plugin_kwargs, plugin_class
from kolossos.train.prelaunch import prepare_run_folder
from kolossos.train.progress import ProgressBar, format_bytes, format_duration
from kolossos.train.schema import all_keys, config_from_dict, config_to_dict
from kolossos.train.setup import lr_lambda

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "configs"


def error_of(overrides: list[str], world_size: int | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config = load_config(None, overrides)
        check_layout(config, world_size or config.nproc_per_node)
    return info.value


def raised(fn: Any, *args: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


def assert_one_paragraph(exc: ConfigError, *parts: str) -> None:
    text = str(exc)
    assert "\n" not in text and text.strip() == text
    for part in parts:
        assert part in text, f"{part!r} not in: {text}"


# --------------------------------------------------------------------------- the three errors
def test_bad_value_names_key_value_and_allowed() -> None:
    exc = error_of(["train.steps=-5"])
    assert exc.key == "train.steps"
    assert_one_paragraph(exc, "train.steps", "-5", "allowed values are integers >= 1")
    assert_one_paragraph(
        error_of(["mixed_precision=fp8"]), "mixed_precision", "'fp8'", "'fp32', 'bf16', 'fp16'"
    )
    assert_one_paragraph(error_of(["model.n_head=5"]), "model.n_head", "5", "divisors of")
    assert_one_paragraph(error_of(["data.tokenizer=word"]), "data.tokenizer", "'char', 'bpe'")


def test_unknown_key_suggests_the_closest() -> None:
    exc = error_of(["model.n_layers=2"])
    assert_one_paragraph(
        exc,
        "'model.n_layers' is not a configuration key",
        "Did you mean 'model.n_layer'?",
        "model.n_embd",
    )
    assert_one_paragraph(error_of(["steps=5"]), "Did you mean 'train.steps'?")
    assert_one_paragraph(error_of(["trian.steps=5"]), "'trian.steps'", "Did you mean 'train.steps'")


def test_impossible_layouts() -> None:
    exc = error_of(["train.batch_size=30"], world_size=4)
    assert exc.key == "train.batch_size"
    assert_one_paragraph(
        exc, "train.batch_size = 30", "multiples of 4", "28 or 32", "--nproc_per_node"
    )
    accum = error_of(["train.batch_size=32", "train.gradient_accumulation=3"], world_size=2)
    assert_one_paragraph(accum, "multiples of 6", "train.gradient_accumulation")
    assert_one_paragraph(error_of(["nproc_per_node=0"]), "nproc_per_node = 0", "integers >= 1")
    tp = error_of(["plugin_kwargs.tp_size=3"], world_size=4)
    assert_one_paragraph(tp, "tp_size=3", "does not divide the 4 processes", "[1, 2, 4]")
    sp = ["plugin_kwargs.sp_size=4"]
    check_layout(load_config(None, sp), 2)  # split_gather-style modes reuse the tp group
    with pytest.raises(ConfigError, match="sp_size=4"):
        check_layout(
            load_config(None, [*sp, "plugin_kwargs.sequence_parallelism_mode=all_to_all"]), 2
        )
    layout = check_layout(load_config(None, ["train.batch_size=32"]), 4)
    assert (layout.dp_size, layout.micro_batch) == (4, 8)


def test_cli_reports_errors_in_one_paragraph_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [f"output_dir={tmp_path}"]
    for argv, needle in (
        ([*base, "train.lr=-1"], "train.lr = -1"),
        ([*base, "modle.n_layer=2"], "Did you mean 'model.n_layer'?"),
        ([*base, "--nproc_per_node", "0"], "--nproc_per_node = 0"),
        ([*base, "--nproc_per_node", "3"], "train.batch_size = 32"),
        ([*base, "plugin=torch_dpp"], "Did you mean 'torch_ddp'?"),
        ([*base, "plugin_kwargs.bucket_cap=1"], "Did you mean 'plugin_kwargs.bucket_cap_mb'?"),
        ([*base, str(tmp_path / "missing.toml")], "does not exist"),
    ):
        assert train_cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("kolossos train: error: ") and needle in err, err
        assert "\n" not in err
    assert not any(tmp_path.iterdir())  # nothing was written


# --------------------------------------------------------------------------- files, overrides
def test_every_format_gives_the_same_config(tmp_path: Path) -> None:
    body = {"name": "x", "model": {"n_layer": 2}, "train": {"steps": 7, "lr": 1}}
    (tmp_path / "c.json").write_text(json.dumps(body))
    (tmp_path / "c.toml").write_text(
        'name = "x"\n[model]\nn_layer = 2\n[train]\nsteps = 7\nlr = 1\n'
    )
    (tmp_path / "c.yaml").write_text("name: x\nmodel: {n_layer: 2}\ntrain: {steps: 7, lr: 1}\n")
    (tmp_path / "c.py").write_text(
        "import math\nSTEPS = 7\n_private = 3\nname = 'x'\nmodel = dict(n_layer=2)\n"
        "train = dict(steps=STEPS, lr=1)\ndef helper():\n    return 1\n"
    )
    configs = {s: load_config(tmp_path / f"c.{s}") for s in ("json", "toml", "yaml", "py")}
    assert len({repr(c) for c in configs.values()}) == 1
    assert configs["py"].train.lr == 1.0 and isinstance(configs["py"].train.lr, float)


def test_example_configs_are_valid() -> None:
    for path in sorted(EXAMPLES.iterdir()):
        config = load_config(path)
        check_layout(config, config.nproc_per_node)
        check_plugin_kwargs(plugin_class(config.plugin), config.plugin_kwargs)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstep = 3\n")
    assert_one_paragraph(raised(load_config, bad), "Did you mean 'train.steps'?", str(bad))
    broken = tmp_path / "broken.toml"
    broken.write_text("[train\n")
    assert "not valid TOML" in str(raised(load_config, broken))
    raising = tmp_path / "raising.py"
    raising.write_text("name = 1 / 0\n")
    assert "ZeroDivisionError" in str(raised(load_config, raising))
    odd = tmp_path / "config.ini"
    odd.write_text("")
    assert ".toml" in str(raised(load_config, odd))


def test_override_values_and_nesting() -> None:
    assert parse_override("train.lr=3e-4") == (["train", "lr"], 3e-4)
    assert parse_override("a=true")[1] is True and parse_override("a=None")[1] is None
    assert parse_override("data.path=~/x.txt")[1] == "~/x.txt"
    assert parse_override("sample.prompt='HAMLET.'")[1] == "HAMLET."
    raw = apply_overrides({"train": {"steps": 3}}, ["train.lr=0.1", "plugin_kwargs.a.b=2"])
    assert raw == {"train": {"steps": 3, "lr": 0.1}, "plugin_kwargs": {"a": {"b": 2}}}
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("train.steps")


def test_round_trip_and_key_listing() -> None:
    config = load_config(None, ["train.steps=9", "plugin_kwargs.bucket_cap_mb=5"])
    assert config_from_dict(config_to_dict(config)) == config
    assert "model.n_layer" in all_keys() and "plugin_kwargs" in all_keys()
    assert did_you_mean("lr", all_keys()) == "train.lr"
    assert TrainConfig().train.final_lr == pytest.approx(TrainConfig().train.lr / 10)


def test_getting_started_lists_every_key_with_its_default() -> None:
    import ast
    import dataclasses
    import re

    text = (REPO / "docs" / "getting-started.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", text, flags=re.M))
    flat = {}
    for key, value in config_to_dict(TrainConfig()).items():
        if isinstance(value, dict) and key != "plugin_kwargs":
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    assert set(rows) == set(flat) == set(all_keys())
    for key, shown in rows.items():
        assert ast.literal_eval(shown) == flat[key], key
    assert dataclasses.is_dataclass(TrainConfig)


# --------------------------------------------------------------------------- plugins
class _FakePlugin(Plugin):
    def __init__(self, size: int = 1, precision: str = "fp32") -> None:
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        self.precision = precision

    def supported_devices(self) -> list[str]:
        return ["cpu"]

    def supported_precisions(self) -> list[str]:
        return ["fp32", "bf16"]

    def control_precision(self) -> bool:
        return True

    def control_device(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return False

    def control_checkpoint_io(self) -> bool:
        return False

    def configure(self, *args: Any, **kwargs: Any) -> Any:
        return args

    def get_checkpoint_io(self) -> Any:
        return None

    def no_sync(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def prepare_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        return None


def test_a_registered_plugin_needs_no_trainer_change(monkeypatch: pytest.MonkeyPatch) -> None:
    from kolossos.booster import plugin as registry

    monkeypatch.setitem(registry.PLUGINS, "fake", _FakePlugin)
    config = load_config(None, ["plugin=fake", "plugin_kwargs.size=2", "mixed_precision=bf16"])
    check_plugin_kwargs(plugin_class("fake"), config.plugin_kwargs)
    plugin = build_plugin(config)
    assert isinstance(plugin, _FakePlugin) and plugin.precision == "bf16"  # precision passed on
    bad = load_config(None, ["plugin=fake", "plugin_kwargs.size=0"])
    exc = raised(build_plugin, bad)
    assert_one_paragraph(exc, "plugin_kwargs.size = 0", "rejected by _FakePlugin", "must be >= 1")
    with pytest.raises(ConfigError, match=r"plugin_kwargs\.sise"):
        check_plugin_kwargs(_FakePlugin, {"sise": 2})
    assert "Did you mean 'fake'?" in str(raised(plugin_class, "fak"))


# --------------------------------------------------------------------------- run folder
def _fake_checkpoint(paths: RunPaths, step: int, config: TrainConfig) -> None:
    folder = paths.checkpoints / checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"step": step, "config": config_to_dict(config)}))


def test_run_folder_rules(tmp_path: Path) -> None:
    config = load_config(None, [f"output_dir={tmp_path}", "name=r"])
    paths = prepare_run_folder(config, resume=False, overwrite=False)
    assert json.loads(paths.config.read_text())["name"] == "r"
    _fake_checkpoint(paths, 10, config)
    exc = raised(prepare_run_folder, config, resume=False, overwrite=False)
    assert_one_paragraph(exc, "already has checkpoints", "step 10", "--resume", "--overwrite")
    assert prepare_run_folder(config, resume=True, overwrite=False) == paths
    changed = load_config(None, [f"output_dir={tmp_path}", "name=r", "model.n_layer=1"])
    exc = raised(prepare_run_folder, changed, resume=True, overwrite=False)
    assert_one_paragraph(exc, "model.n_layer: 3 -> 1")
    prepare_run_folder(changed, resume=False, overwrite=True)
    assert paths.latest_checkpoint() is None


# --------------------------------------------------------------------------- other pure logic
def test_batches_depend_only_on_seed_and_step() -> None:
    ids = torch.arange(1000) % 50
    corpus = Corpus(
        train_ids=ids[:900], val_ids=ids[900:], tokenizer=CharTokenizer("ab"), source="x"
    )
    a = corpus.train_batch(3, seed=1, batch_size=8, block=16)
    assert torch.equal(a, corpus.train_batch(3, seed=1, batch_size=8, block=16))
    assert not torch.equal(a, corpus.train_batch(4, seed=1, batch_size=8, block=16))
    assert a.shape == (8, 16) and torch.equal(a[:, 1:], (a[:, :-1] + 1) % 50)
    val = corpus.val_batches(seed=1, count=2, batch_size=4, block=16)
    assert val.shape == (2, 4, 16) and int(val.max()) < 50


def test_char_tokenizer_round_trip() -> None:
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocab_size == 8 and tok.decode(tok.encode("low dew")) == "low dew"
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("zz")


def test_schedule_warms_up_then_decays() -> None:
    train = load_config(None, ["train.steps=100", "train.warmup_steps=10"]).train
    factor = lr_lambda(train)
    assert factor(0) < factor(9) < factor(10) == pytest.approx(1.0)
    assert factor(100) == pytest.approx(0.1) and factor(55) < factor(20)


def test_progress_line_and_formats() -> None:
    bar = ProgressBar(total=200, live=False, log_interval=10, stream=io.StringIO())
    bar.mem = [412e6, 409e6]
    bar.val_loss = 2.5
    line = bar.line(50, 3.14159, 12345.0)
    for part in ("step  50/200", "25%", "loss 3.1416", "val 2.5000", "12.3k tok/s", "393M 390M"):
        assert part in line, line
    assert format_duration(75.2) == "1:15" and format_duration(3723) == "1:02:03"
    assert format_bytes(2048) == "2K"


def test_basic_png_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kolossos.train.plot import write_loss_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    out = tmp_path / "loss.png"
    assert write_loss_plot([(1, 4.0), (2, 3.0), (3, 2.5)], [(0, 4.2), (3, 2.6)], out) == "basic"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_built_in_default_fits_a_one_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in default starts 2 processes; on a machine with one GPU it starts one (NCCL
    refuses two processes on one device), unless an override asked for the count."""
    import kolossos.accelerator as accelerator_module

    class OneGpu:
        name = "cuda"

        def device_count(self) -> int:
            return 1

    default = load_config(None)
    assert default.nproc_per_node == 2
    monkeypatch.setattr(accelerator_module, "get_accelerator", lambda: OneGpu())
    assert train_cli._fit_default_to_devices(default, []).nproc_per_node == 1
    pinned = load_config(None, ["nproc_per_node=2"])
    assert train_cli._fit_default_to_devices(pinned, ["nproc_per_node=2"]).nproc_per_node == 2
    monkeypatch.setattr(OneGpu, "name", "cpu")
    assert train_cli._fit_default_to_devices(default, []).nproc_per_node == 2
