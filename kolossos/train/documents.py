"""The documents of a data set: plain text files or folders, JSON Lines with a text field,
instruction records (prompt and response), or Parquet columns.

Standard library only (Parquet needs ``pyarrow``, ``datasets`` folders ``datasets``: the
extra ``kolossos[data]``, imported only for those formats), so ``kolossos train`` reads and
checks the data before it starts a process: a line without the field, or a data set without text, is
refused with the file and line named, and nothing is written.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kolossos.train.config import DataSection
from kolossos.train.errors import ConfigError

__all__ = [
    "SUFFIXES",
    "Document",
    "data_digest",
    "data_files",
    "is_instruction",
    "is_packed",
    "read_documents",
]

#: the files of a data folder each format reads
SUFFIXES = {
    "text": (".txt",),
    "jsonl": (".jsonl", ".json"),
    "instruction": (".jsonl", ".json"),
    "parquet": (".parquet",),
    "datasets": (".arrow", ".json"),  # a save_to_disk folder: its files key the token cache
}


@dataclass(frozen=True)
class Document:
    """One training document."""

    text: str
    """The text trained on (the response of an instruction record)."""
    prompt: str = ""
    """Text before it that the model reads but is not trained to produce (masked out of the
    loss)."""


def is_packed(section: DataSection) -> bool:
    """Whether the data goes through the token cache and packing: everything except the
    original corpus mode (``format='text'`` with the run's own ``char`` or ``bpe`` tokenizer:
    one text file, or the bundled one, sampled in random windows)."""
    return not (section.format == "text" and section.tokenizer in ("char", "bpe"))


def data_files(section: DataSection) -> list[Path]:
    """The files of ``data.path``: the file itself, or the folder's files of the format's
    suffixes (recursively, in name order); the bundled corpus for ``None``.

    Raises:
        ConfigError: a missing path, or a folder without such files.
    """
    if section.path is None:
        from kolossos.train.data import bundled_corpus

        return [bundled_corpus()]
    given = section.path
    path = Path(given).expanduser()
    if not path.exists():
        raise ConfigError(
            "data.path",
            given,
            problem=f"data.path = {given!r} does not exist.",
            hint="Pass a data file or a folder of them.",
        )
    if path.is_file() and section.format != "datasets":
        return [path]
    suffixes = SUFFIXES[section.format]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not files:
        raise ConfigError(
            "data.path",
            given,
            problem=f"data.path = {given!r} is a folder without {' or '.join(suffixes)} files "
            f"(data.format = {section.format!r}).",
            hint="Point data.path at the data, or set data.format to the files' format.",
        )
    return files


def data_digest(files: list[Path]) -> str:
    """A digest of the files' names and contents (the token cache's key)."""
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(str(file.resolve()).encode() + b"\0")
        with file.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _field(record: object, name: str, key: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ConfigError(
            "data.path",
            problem=f"{where} is not a JSON object (data.format needs one object per line).",
            hint="Fix the line, or set data.format='text' for plain text.",
        )
    value = record.get(name)
    if not isinstance(value, str):
        found = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        shown = "is missing" if value is None else f"is not a string ({type(value).__name__})"
        raise ConfigError(
            key,
            name,
            problem=f"{where}: the field {name!r} ({key}) {shown}; the line has the fields "
            f"{found}.",
            hint=f"Fix the line, or set {key} to the field that holds the text.",
        )
    return value


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "data.path",
            str(file),
            "readable UTF-8 text files",
            hint=f"Reading {str(file)!r} failed: {exc}.",
        ) from None


def _read_jsonl(file: Path, section: DataSection) -> list[Document]:
    docs = []
    for number, line in enumerate(_read_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                "data.path", problem=f"{where} is not valid JSON ({exc}).", hint="Fix the line."
            ) from None
        if is_instruction(section):
            prompt = _field(record, section.prompt_field, "data.prompt_field", where)
            response = _field(record, section.response_field, "data.response_field", where)
            docs.append(Document(text=response, prompt=prompt))
        else:
            docs.append(Document(text=_field(record, section.text_field, "data.text_field", where)))
    return docs


def is_instruction(section: DataSection) -> bool:
    """Whether the records are prompt/response pairs (``format='instruction'``, or
    ``data.instruction = true``)."""
    return section.format == "instruction" or section.instruction


def _needs(module: str, fmt: str) -> Any:
    """Import the optional ``module`` that ``data.format = fmt`` reads with."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        package = module.split(".")[0]
        raise ConfigError(
            "data.format",
            fmt,
            problem=f"data.format = {fmt!r} needs the {package!r} package, which is not installed.",
            hint=f"Install it: pip install 'kolossos[data]' (or pip install {package}), or "
            "convert the data to JSON Lines.",
        ) from None


def _from_columns(
    columns: dict[str, list[Any]], where: str, section: DataSection
) -> list[Document]:
    """The documents of a table's columns (``columns`` holds the fields the section reads)."""
    values = list(columns.values())
    rows = len(values[0]) if values else 0
    for name, column in columns.items():
        for row, value in enumerate(column):
            if not isinstance(value, str):
                raise ConfigError(
                    "data.path",
                    problem=f"{where}: row {row} of the column {name!r} is "
                    f"{'empty (null)' if value is None else type(value).__name__}, not a string.",
                    hint="Fix or drop the row, or point the field at a text column.",
                )
    if is_instruction(section):
        prompts, responses = columns[section.prompt_field], columns[section.response_field]
        return [Document(text=responses[i], prompt=prompts[i]) for i in range(rows)]
    return [Document(text=t) for t in columns[section.text_field]]


def _wanted(section: DataSection, present: list[str], where: str) -> list[str]:
    """The columns the section reads, checked against the ``present`` ones."""
    if is_instruction(section):
        wanted = [("data.prompt_field", section.prompt_field)]
        wanted.append(("data.response_field", section.response_field))
    else:
        wanted = [("data.text_field", section.text_field)]
    for key, name in wanted:
        if name not in present:
            raise ConfigError(
                key,
                name,
                problem=f"{where} has no column {name!r} ({key}); its columns are "
                f"{', '.join(repr(c) for c in present) or 'none'}.",
                hint=f"Set {key} to the column that holds it.",
            )
    return [name for _, name in wanted]


def _read_parquet(file: Path, section: DataSection) -> list[Document]:
    pq = _needs("pyarrow.parquet", "parquet")
    try:
        present = list(pq.read_schema(file).names)
        names = _wanted(section, present, str(file))
        table = pq.read_table(file, columns=names)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(
            "data.path",
            str(file),
            "readable Parquet files",
            hint=f"Reading {str(file)!r} failed: {exc}.",
        ) from None
    columns = {n: table.column(n).to_pylist() for n in names}
    return _from_columns(columns, str(file), section)


def _read_saved_dataset(section: DataSection) -> list[Document]:
    datasets = _needs("datasets", "datasets")
    folder = str(Path(str(section.path)).expanduser())
    try:
        loaded = datasets.load_from_disk(folder)
    except IndexError:  # datasets fails so on a folder saved without any row (no shards)
        raise ConfigError(
            "data.path",
            section.path,
            problem=f"data.path = {section.path!r} holds no rows: the data set is empty.",
            hint="Check the path, or save the data set again with its rows.",
        ) from None
    except (OSError, ValueError) as exc:  # not a save_to_disk folder
        raise ConfigError(
            "data.path",
            section.path,
            "a folder written by datasets' save_to_disk",
            hint=f"load_from_disk({folder!r}) failed: {exc}.",
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(
                "data.path",
                section.path,
                problem=f"data.path = {section.path!r} holds the splits {', '.join(loaded)} "
                "but no 'train' split.",
                hint="Save the training split as 'train', or point data.path at its folder.",
            )
        loaded = loaded["train"]
    present = list(loaded.column_names)
    names = _wanted(section, present, str(section.path))
    columns = {n: loaded.data.column(n).to_pylist() for n in names}  # the Arrow table
    return _from_columns(columns, str(section.path), section)


def read_documents(section: DataSection) -> list[Document]:
    """Every document of ``data.path`` in file order.

    Raises:
        ConfigError: unreadable files, a JSON line that is not an object or lacks the field
            (naming the file, the line and the key), or a data set without any text.
    """
    docs: list[Document] = []
    files = data_files(section)
    if section.format == "datasets":
        docs, files = _read_saved_dataset(section), []
    for file in files:
        if section.format == "text":
            docs.append(Document(text=_read_text(file)))
        elif section.format == "parquet":
            docs += _read_parquet(file, section)
        else:
            docs += _read_jsonl(file, section)
    docs = [d for d in docs if d.text or d.prompt]
    if not any(d.text for d in docs):
        raise ConfigError(
            "data.path",
            section.path,
            problem=f"data.path = {section.path!r} holds no text to train on (data.format = "
            f"{section.format!r}): the data set is empty.",
            hint="Check the path and the format.",
        )
    return docs
