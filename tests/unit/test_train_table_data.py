"""``kolossos train`` data from Parquet files and ``datasets.save_to_disk`` folders (text and
instruction columns) gives the token stream of the same records as JSON Lines; their bad input
is refused naming the column; and tokenising in a process pool (``data.num_proc``) gives the
serial tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from kolossos.train.config import DataSection
from kolossos.train.documents import Document, read_documents
from kolossos.train.errors import ConfigError
from kolossos.train.hf_model import load_hf_tokenizer
from kolossos.train.packed import load_packed, tokenize_documents
from kolossos.train.tiny import make_tiny_checkpoint
from kolossos.train.tokenize_pool import PARALLEL_MIN_CHARS, auto_procs

WORDS = ["the", "king", "queen", "night", "crown", "sword", "love", "death", "é", "日本"]
RECORDS = [
    {
        "text": " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 9)),
        "prompt": f"Q{i}: " + WORDS[i % len(WORDS)] + "?\nA:",
        "response": " " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 4)),
        "n": i,
    }
    for i in range(40)
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "llama")


def write_all(folder: Path, records: list[dict[str, object]]) -> dict[str, Path]:
    """The records as JSON Lines, as two Parquet files (a folder) and as a saved dataset."""
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    parquet = folder / "parquet"
    parquet.mkdir()
    half = (len(records) + 1) // 2
    for name, part in (("a.parquet", records[:half]), ("b.parquet", records[half:])):
        if part:
            pq.write_table(pa.Table.from_pylist(part), parquet / name)
    saved = folder / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    return {"jsonl": jsonl, "parquet": parquet, "datasets": saved}


@pytest.mark.parametrize("instruction", [False, True], ids=["text", "instruction"])
def test_tables_give_the_tokens_of_the_same_jsonl(
    model: Path, tmp_path: Path, instruction: bool
) -> None:
    files = write_all(tmp_path / "data", RECORDS)
    streams = {}
    for fmt, path in files.items():
        section = DataSection(
            path=str(path), format=fmt, tokenizer=str(model), instruction=instruction
        )
        corpus = load_packed(section, 8, tmp_path / "tok.json", tmp_path / "cache")
        streams[fmt] = (np.asarray(corpus.ids), np.asarray(corpus.mask))
    for fmt in ("parquet", "datasets"):
        assert np.array_equal(streams[fmt][0], streams["jsonl"][0]), fmt
        assert np.array_equal(streams[fmt][1], streams["jsonl"][1]), fmt
    assert (streams["jsonl"][1] == 0).any() == instruction  # prompts masked only then
    # format='instruction' is jsonl with instruction=true
    if instruction:
        section = DataSection(path=str(files["jsonl"]), format="instruction", tokenizer=str(model))
        assert read_documents(section)[0] == Document(RECORDS[0]["response"], RECORDS[0]["prompt"])  # type: ignore[arg-type]
    assert len(list((tmp_path / "cache").iterdir())) == 3  # one cache entry per data set


def test_the_cache_key_follows_the_table_contents(model: Path, tmp_path: Path) -> None:
    files = write_all(tmp_path / "data", RECORDS)
    cache = tmp_path / "cache"
    for fmt in ("parquet", "datasets"):
        section = DataSection(path=str(files[fmt]), format=fmt, tokenizer=str(model))
        load_packed(section, 8, tmp_path / "tok.json", cache)
        load_packed(section, 8, tmp_path / "tok.json", cache)
    assert len(list(cache.iterdir())) == 2
    changed = write_all(tmp_path / "changed", [*RECORDS[:-1], {**RECORDS[-1], "text": "other"}])
    for fmt in ("parquet", "datasets"):
        section = DataSection(path=str(changed[fmt]), format=fmt, tokenizer=str(model))
        load_packed(section, 8, tmp_path / "tok.json", cache)
    assert len(list(cache.iterdir())) == 4


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_a_missing_column_names_it_and_the_columns_present(tmp_path: Path, fmt: str) -> None:
    files = write_all(tmp_path / "data", [{"body": "a b", "n": 1}])
    with pytest.raises(ConfigError) as err:
        read_documents(DataSection(path=str(files[fmt]), format=fmt))
    text = str(err.value)
    assert err.value.key == "data.text_field"
    assert "no column 'text'" in text and "'body', 'n'" in text, text
    with pytest.raises(ConfigError) as err:
        read_documents(DataSection(path=str(files[fmt]), format=fmt, instruction=True))
    assert err.value.key == "data.prompt_field" and "no column 'prompt'" in str(err.value)


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_an_empty_table_is_refused(tmp_path: Path, fmt: str) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    schema = pa.schema([("text", pa.string())])
    if fmt == "parquet":
        pq.write_table(schema.empty_table(), folder / "x.parquet")
    else:
        datasets.Dataset.from_dict({"text": []}).save_to_disk(str(folder))
    with pytest.raises(ConfigError, match="the data set is empty"):
        read_documents(DataSection(path=str(folder), format=fmt))


def test_null_rows_and_unreadable_files_are_refused(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": None}]), tmp_path / "n.parquet")
    with pytest.raises(ConfigError, match=r"row 1 of the column 'text' is empty \(null\)"):
        read_documents(DataSection(path=str(tmp_path / "n.parquet"), format="parquet"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="readable Parquet files"):
        read_documents(DataSection(path=str(tmp_path / "bad.parquet"), format="parquet"))
    (tmp_path / "notsaved").mkdir()
    (tmp_path / "notsaved" / "x.arrow").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="save_to_disk"):
        read_documents(DataSection(path=str(tmp_path / "notsaved"), format="datasets"))


def test_instruction_needs_records() -> None:
    with pytest.raises(ConfigError, match=r"data\.format = 'text'"):
        DataSection(format="text", instruction=True)
    with pytest.raises(ConfigError, match="num_proc"):
        DataSection(num_proc=0)


# --------------------------------------------------------------------------- parallel
def test_a_process_pool_gives_the_serial_tokens(model: Path) -> None:
    from kolossos.train.data import BPETokenizer, CharTokenizer

    docs = [Document(text=str(r["text"]), prompt=str(r["prompt"]) * (i % 2)) for i, r in
            enumerate(RECORDS * 3)]  # fmt: skip
    text = "".join(d.prompt + d.text for d in docs)
    tokenizers = {
        "hf": (load_hf_tokenizer(str(model)), 2),
        "bpe": (BPETokenizer.train(text, 300), None),
        "char": (CharTokenizer.from_text(text), None),
    }
    for name, (tok, eos) in tokenizers.items():
        serial = tokenize_documents(docs, tok, eos, num_proc=1)
        for procs in (2, 3):
            ids, mask = tokenize_documents(docs, tok, eos, num_proc=procs)
            assert np.array_equal(ids, serial[0]) and np.array_equal(mask, serial[1]), name
        # by hand: prompt (masked), text, end of text
        want: list[int] = []
        for d in docs:
            prompt = tok.encode(d.prompt) if d.prompt else []
            want += prompt + tok.encode(d.text) + ([] if eos is None else [eos])
        assert serial[0].tolist() == want, name
        assert serial[1].dtype == np.uint8 and int((serial[1] == 0).sum()) > 0, name


def test_automatic_processes() -> None:
    assert auto_procs(PARALLEL_MIN_CHARS - 1, cpus=16) == 1
    assert auto_procs(PARALLEL_MIN_CHARS, cpus=2) == 1
    assert auto_procs(PARALLEL_MIN_CHARS, cpus=4) == 4
    assert auto_procs(PARALLEL_MIN_CHARS, cpus=64) == 8


@pytest.mark.parametrize(
    ("fmt", "module"), [("parquet", "pyarrow.parquet"), ("datasets", "datasets")]
)
def test_without_the_package_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, module: str
) -> None:
    files = write_all(tmp_path / "data", RECORDS[:2])
    monkeypatch.setitem(__import__("sys").modules, module, None)  # import raises
    with pytest.raises(ConfigError) as err:
        read_documents(DataSection(path=str(files[fmt]), format=fmt))
    text = str(err.value)
    assert err.value.key == "data.format", text
    package = module.split(".")[0]
    assert f"needs the '{package}' package" in text and "pip install 'kolossos[data]'" in text


def test_kolossos_train_refuses_bad_tables_before_writing(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kolossos.cli.main import main as kolossos_main

    files = write_all(tmp_path / "data", [{"body": "a b"}])
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(empty))
    cases = [
        (["data.format=parquet", f"data.path={files['parquet']}"], ["no column 'text'", "'body'"]),
        (["data.format=datasets", f"data.path={empty}"], ["the data set is empty"]),
    ]
    for args, words in cases:
        code = kolossos_main(["train", f"model.pretrained={model}", *args,
                              f"output_dir={tmp_path / 'runs'}"])  # fmt: skip
        message = " ".join(capsys.readouterr().err.split())
        assert code == 2 and all(w in message for w in words), message
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_saved_dataset_dict_trains_on_its_train_split(tmp_path: Path) -> None:
    rows = datasets.Dataset.from_list([{"text": "a b"}, {"text": "c"}])
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "dict"))
    got = read_documents(DataSection(path=str(tmp_path / "dict"), format="datasets"))
    assert got == [Document("a b"), Document("c")]
    datasets.DatasetDict({"test": rows}).save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(ConfigError, match="holds the splits test but no 'train' split"):
        read_documents(DataSection(path=str(tmp_path / "no-train"), format="datasets"))
