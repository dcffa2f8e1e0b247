"""``kolossos serve CONFIG.py``: Energon-AI's ``opt_config.py`` keys read into the server options,
command-line options winning, and one clear error (naming the key) per bad file. The whole
server end to end: ``tests/e2e/test_inference_serve_opt_config.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kolossos.cli import serve
from kolossos.cli.serve_config import ServeConfigError, read_serve_config


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A stand-in checkpoint folder: an OPT config.json and a tokenizer file."""
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "opt"}))
    (model / "tokenizer.json").write_text("{}")
    return model


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "opt_config.py"
    path.write_text(text)
    return path


ENERGON = """
from math import sqrt            # modules, functions, classes and _names are not keys
_HERE = 'ckpt'
model_class = opt_125M
checkpoint = _HERE
tp_init_size = 2
pp_init_size = 1
host = '0.0.0.0'
port = 8021
executor_max_batch_size = 16
cache_size = 50
cache_list_size = 2
"""


def test_energon_keys_map_onto_the_options(tmp_path: Path, folder: Path) -> None:
    options = read_serve_config(write(tmp_path, ENERGON))
    assert options == {
        "model_dir": str(folder.resolve()), "tp": 2, "pp": 1, "host": "0.0.0.0", "port": 8021,
        "executor_max_batch_size": 16, "cache_size": 50, "cache_list_size": 2,
    }  # fmt: skip
    text = ENERGON.replace("opt_125M", "'OPTForCausalLM'") + "batching = 'static'\n"
    assert read_serve_config(write(tmp_path, text))["batching"] == "static"


def test_command_line_options_override_the_file(tmp_path: Path, folder: Path) -> None:
    config = str(write(tmp_path, ENERGON))
    parser = serve.build_parser()
    argv = [config, "--tp", "1", "--cache-size=0"]
    args = parser.parse_args(argv)
    assert serve._apply_config(parser, args, argv) is None
    assert (args.tp, args.cache_size, args.port) == (1, 0, 8021)
    assert args.model_dir == str(folder.resolve())


BAD = [
    ("model_class = opt_125M\n", "the key 'checkpoint' is missing"),
    ("checkpoint = 'ckpt'\n", "the key 'model_class' is missing"),
    ("model_class = opt_125M\ncheckpoint = 'ckpt'\ntp_size = 2\n", "unknown key 'tp_size'"),
    ("model_class = opt_125M\ncheckpoint = 'ckpt'\nhalf = True\n", "Energon-AI key 'half'"),
    ("model_class = opt_125M\ncheckpoint = 'ckpt'\ntp_init_size = '2'\n", "tp_init_size = '2'"),
    ("model_class = opt_125M\ncheckpoint = 'ckpt'\ncache_size = -1\n", "cache_size = -1"),
    ("model_class = 'bert'\ncheckpoint = 'ckpt'\n", "model_class = 'bert' must be"),
    ("model_class = llama_7B\ncheckpoint = 'ckpt'\n", "holds a 'opt' model"),
    ("from energonai.model import opt_125M\n", "importing 'energonai' failed"),
    ("model_class = opt_125M\ncheckpoint = 1 / 0\n", "raised ZeroDivisionError"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_files_name_the_key(tmp_path: Path, folder: Path, text: str, message: str) -> None:
    with pytest.raises(ServeConfigError, match=message.replace("(", r"\(")):
        read_serve_config(write(tmp_path, text))


def test_cli_reports_a_bad_file(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve.main([str(write(tmp_path, BAD[2][0]))]) == 2
    assert "unknown key 'tp_size'" in capsys.readouterr().err
    assert serve.main([str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
