"""``kolossos train`` with Hugging Face models and real data formats, without processes: local
checkpoints in every weight layout, from-scratch configs, instruction packing with masked
prompts, the token cache, resumable shuffling, and the pre-launch refusals of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from kolossos.cli.main import main as kolossos_main
from kolossos.train import load_config
from kolossos.train.config import DataSection
from kolossos.train.errors import ConfigError
from kolossos.train.hf_model import build_hf_model, load_hf_tokenizer
from kolossos.train.packed import IGNORE_INDEX, PackedCorpus, load_packed
from kolossos.train.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny LLaMA saved three ways (same seed, same weights), a GPT-2 with only 100
    embedding rows and no tokenizer, and a data folder."""
    root = tmp_path_factory.mktemp("hf")
    out = {w: make_tiny_checkpoint(root / w, weights=w) for w in ("safetensors", "bin", "sharded")}
    out["small-gpt2"] = make_tiny_checkpoint(
        root / "small-gpt2", family="gpt2", vocab_size=100, tokenizer=False
    )
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 17, 42, 7]])).logits


def test_every_weight_layout_loads_the_same_model(models: dict[str, Path]) -> None:
    reference = None
    for layout in ("safetensors", "bin", "sharded"):
        config = load_config(None, [f"model.pretrained={models[layout]}"])
        assert config.data.tokenizer == str(models[layout])  # the model's own tokenizer
        model = build_hf_model(config.model, load_hf_tokenizer(config.data.tokenizer).vocab_size)
        assert type(model).__name__ == "LlamaForCausalLM"
        logits = _logits(model)
        if reference is None:
            reference = logits
        torch.testing.assert_close(logits, reference, atol=0, rtol=0)


def test_model_config_trains_a_fresh_model_of_that_family(models: dict[str, Path]) -> None:
    folder = models["safetensors"]
    config = load_config(
        None, [f"model.config={folder / 'config.json'}", f"data.tokenizer={folder}"]
    )
    torch.manual_seed(3)
    fresh = build_hf_model(config.model, 320)
    torch.manual_seed(3)
    again = build_hf_model(config.model, 320)
    pretrained = build_hf_model(load_config(None, [f"model.pretrained={folder}"]).model, 320)
    assert type(fresh).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(fresh), _logits(again), atol=0, rtol=0)
    assert not torch.allclose(_logits(fresh), _logits(pretrained))


def test_a_tokenizer_larger_than_the_embedding_is_refused(models: dict[str, Path]) -> None:
    config = load_config(
        None,
        [f"model.pretrained={models['small-gpt2']}", f"data.tokenizer={models['safetensors']}"],
    )
    with pytest.raises(ConfigError, match=r"320 ids .* only 100 embedding rows") as err:
        build_hf_model(config.model, 320)
    assert err.value.key == "data.tokenizer"


def _instructions(path: Path, records: list[dict[str, str]]) -> None:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")


RECORDS = [
    {"prompt": f"Q: what is {w}?\nA:", "response": f" {w} is a word of the king."}
    for w in ("love", "night", "crown", "sword", "blood", "heart", "queen", "death")
]


def test_instruction_data_is_packed_with_prompts_masked(
    models: dict[str, Path], tmp_path: Path
) -> None:
    folder = models["safetensors"]
    data = tmp_path / "data.jsonl"
    _instructions(data, RECORDS)
    section = DataSection(path=str(data), format="instruction", tokenizer=str(folder))
    cache = tmp_path / "cache"
    corpus = load_packed(section, 16, tmp_path / "tok.json", cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    ids: list[int] = []
    labels: list[int] = []
    for r in RECORDS:  # by hand: prompt (masked), response, end of text
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        a = tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, labels = ids + p + a, labels + [IGNORE_INDEX] * len(p) + a
    n = len(ids) // 16
    assert corpus.n_train + corpus.n_val == n and corpus.n_val == max(1, round(n * 0.1))
    for i in range(n):
        x, y = corpus.sequence(i)
        assert x.tolist() == ids[i * 16 : (i + 1) * 16]
        assert y.tolist() == labels[i * 16 : (i + 1) * 16]
    # cached: a second load reads the token file; other data makes another one
    (entry,) = [p for p in cache.iterdir()]
    stamp = (entry / "ids.bin").stat().st_mtime_ns
    again = load_packed(section, 16, tmp_path / "tok.json", cache)
    assert isinstance(again.ids, np.memmap) and (entry / "ids.bin").stat().st_mtime_ns == stamp
    _instructions(data, RECORDS[:-1])
    load_packed(section, 16, tmp_path / "tok.json", cache)
    assert len(list(cache.iterdir())) == 2


def test_shuffling_visits_every_sequence_once_per_epoch_and_repeats() -> None:
    empty = np.zeros(0, dtype=np.int32)
    corpus = PackedCorpus(
        ids=empty, mask=empty, block=4, n_train=10, n_val=1, tokenizer=None, source=""
    )
    order = torch.cat([corpus.train_indices(s, seed=5, batch_size=4) for s in range(1, 6)])
    assert sorted(order[:10].tolist()) == list(range(10))  # epoch 1
    assert sorted(order[10:20].tolist()) == list(range(10))  # epoch 2, another order
    assert order[:10].tolist() != order[10:20].tolist()
    assert torch.equal(corpus.train_indices(4, seed=5, batch_size=4), order[12:16])  # resumable
    assert not torch.equal(corpus.train_indices(4, seed=6, batch_size=4), order[12:16])


# --------------------------------------------------------------------------- bad input
def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert kolossos_main(["train", *args]) == 2
    return " ".join(capsys.readouterr().err.split())


def _earlier_run(root: Path) -> dict[str, bytes]:
    run = root / "runs" / "ft"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "trainer_state.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"kind": "train"}\n')
    return {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _cases(models: dict[str, Path], tmp: Path) -> list[tuple[list[str], list[str]]]:
    good = models["safetensors"]
    config_only = tmp / "config-only"
    config_only.mkdir()
    shutil.copy(good / "config.json", config_only)
    lost_shard = tmp / "lost-shard"
    shutil.copytree(models["sharded"], lost_shard)
    (lost_shard / "model-00002-of-00007.safetensors").unlink()
    no_field = tmp / "no-field.jsonl"
    no_field.write_text('{"text": "a"}\n{"body": "b"}\n')
    empty = tmp / "empty.jsonl"
    empty.write_text("\n\n")
    data = [f"data.path={tmp / 'ok.jsonl'}", "data.format=jsonl"]
    (tmp / "ok.jsonl").write_text('{"text": "the king"}\n')
    return [
        ([f"model.pretrained={tmp / 'nowhere'}", *data], ["model.pretrained", "does not exist"]),
        ([f"model.pretrained={config_only}", *data], ["config.json but no weights"]),
        ([f"model.pretrained={lost_shard}", *data], ["model-00002-of-00007", "missing"]),
        (
            [f"model.pretrained={models['small-gpt2']}", f"data.tokenizer={good}", *data],
            ["data.tokenizer", "320 ids", "only 100 embedding rows"],
        ),
        (
            [f"model.pretrained={good}", f"data.path={no_field}", "data.format=jsonl"],
            [f"{no_field}:2", "'text' (data.text_field) is missing", "'body'"],
        ),
        (
            [f"model.pretrained={good}", f"data.path={empty}", "data.format=jsonl"],
            ["data set is empty"],
        ),
        (
            [
                f"model.pretrained={good}",
                *data,
                "plugin=hybrid_parallel",
                "plugin_kwargs.tp_size=3",
                "--nproc_per_node",
                "3",
                "train.batch_size=63",
            ],
            ["plugin_kwargs.tp_size", "attention heads of model.pretrained=4"],
        ),
        (
            [
                f"model.pretrained={good}",
                *data,
                "plugin=hybrid_parallel",
                "plugin_kwargs.tp_size=4",
                "--nproc_per_node",
                "4",
                "train.batch_size=4",
            ],
            ["plugin_kwargs.tp_size = 4", "key/value heads of model.pretrained=2"],
        ),
        (
            [
                f"model.pretrained={good}",
                *data,
                "plugin=hybrid_parallel",
                "plugin_kwargs.tp_size=1",
                "plugin_kwargs.pp_size=4",
                "plugin_kwargs.num_microbatches=1",
                "--nproc_per_node",
                "4",
                "train.batch_size=4",
            ],
            ["plugin_kwargs.pp_size = 4", "the blocks of model.pretrained = 2", ">= 4 blocks"],
        ),
    ]


def test_bad_input_is_refused_before_anything_is_written(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _earlier_run(tmp_path)
    for args, words in _cases(models, tmp_path):
        message = _refused([*args, f"output_dir={tmp_path / 'runs'}", "name=ft"], capsys)
        for word in words:
            assert word in message, (word, message)
        after = {str(p): p.read_bytes() for p in (tmp_path / "runs").rglob("*") if p.is_file()}
        assert after == before, args


def test_the_runs_own_tokenizers_export_as_transformers_tokenizers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kolossos.train.data import BPETokenizer, CharTokenizer
    from kolossos.train.export import hf_tokenizer_of

    text = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind"
    for name, tok in (
        ("char", CharTokenizer.from_text(text)),
        ("bpe", BPETokenizer.train(text * 20, 300)),
    ):
        hf_tokenizer_of(tok).save_pretrained(str(tmp_path / name))
        loaded = AutoTokenizer.from_pretrained(str(tmp_path / name))
        sample = "that is the question,\nnot to be"
        ids = loaded(sample, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(sample), name
        assert loaded.decode(ids) == tok.decode(ids) == sample, name


def test_export_and_generate_refuse_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kolossos_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a kolossos train run folder" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    assert kolossos_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    assert kolossos_main(["export", str(tmp_path), str(tmp_path / "full")]) == 2
    assert "never writes over files" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep"
    assert kolossos_main(["generate", str(tmp_path / "nowhere"), "--prompt", "a"]) == 2
    assert "does not exist" in capsys.readouterr().err


OPTIONAL = [("parquet", "pyarrow", "data.parquet"), ("datasets", "datasets", "saved/x.arrow")]


@pytest.mark.parametrize(("fmt", "module", "suffix"), OPTIONAL)
def test_optional_formats_name_their_install(
    tmp_path: Path, fmt: str, module: str, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from kolossos.train.documents import read_documents

    # Without the package, whether or not this machine has it: a None entry in sys.modules makes
    # its import fail as a missing module does.
    for name in (module, f"{module}.parquet"):
        monkeypatch.setitem(sys.modules, name, None)

    file = tmp_path / suffix
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(b"\0")
    section = DataSection(path=str(tmp_path / suffix.split("/")[0]), format=fmt)
    with pytest.raises(ConfigError, match=f"pip install {module}") as err:
        read_documents(section)
    assert err.value.key == "data.format" and "pip install 'kolossos[data]'" in str(err.value)


def test_learning_rate_schedules() -> None:
    from kolossos.train.setup import lr_lambda

    common = ["train.steps=100", "train.warmup_steps=10", "train.min_lr=0.0005"]
    cosine, linear, constant = (
        lr_lambda(load_config(None, [*common, f"train.schedule={name}"]).train)
        for name in ("cosine", "linear", "constant")
    )
    for factor in (cosine, linear, constant):
        assert factor(0) == pytest.approx(1 / 11) and factor(10) == pytest.approx(1.0)
    assert linear(55) == pytest.approx(1 - 0.9 * 0.5) and linear(100) == pytest.approx(0.1)
    assert cosine(55) == pytest.approx(0.55) and cosine(100) == pytest.approx(0.1)
    assert constant(55) == constant(100) == 1.0
    with pytest.raises(ConfigError, match="'cosine', 'linear', 'constant'"):
        load_config(None, ["train.schedule=step"])
