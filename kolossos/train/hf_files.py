"""Checks of a local Hugging Face model folder and its ``config.json`` that need no package
beyond the standard library, so ``kolossos train`` can refuse a missing or incomplete folder
before it starts a process (and before it writes anything)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kolossos.train.errors import ConfigError

__all__ = [
    "WEIGHT_FILES",
    "HFShape",
    "check_model_folder",
    "check_tokenizer_folder",
    "check_vocabulary",
    "hf_shape",
    "tokenizer_size",
]

#: single-file weights, then the index of sharded ones, in the order transformers looks for them
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: files one of which makes a folder a tokenizer folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class HFShape:
    """What the trainer's pre-launch checks need from a ``config.json``."""

    model_type: str
    """The architecture family (``llama``, ``gpt2``, ...)."""
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block."""
    max_positions: int | None
    """The longest context the position encoding allows, if the config says."""
    vocab_size: int | None
    """The embedding rows."""
    n_kv_head: int | None = None
    """Key/value heads of grouped-query attention (``None``: one per attention head)."""


def _config_file(path: Path) -> Path:
    return path / "config.json" if path.is_dir() else path


def _read_config(key: str, given: str) -> dict[str, Any]:
    path = Path(given).expanduser()
    file = _config_file(path)
    if not path.exists():
        raise ConfigError(
            key,
            given,
            problem=f"{key} = {given!r}: {str(path)!r} does not exist.",
            hint="Pass a local Hugging Face model folder (config.json plus weights); nothing is "
            "downloaded.",
        )
    if not file.is_file():
        raise ConfigError(
            key,
            given,
            problem=f"{key} = {given!r}: the folder has no config.json, so it is not (or not "
            "completely) a Hugging Face model folder.",
            hint="Copy the whole model folder (config.json, weights, tokenizer files).",
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            key, given, problem=f"{key} = {given!r}: {file} is not valid JSON ({exc})."
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(
            key,
            given,
            problem=f"{key} = {given!r}: {file} has no 'model_type', so the architecture is "
            "unknown.",
            hint="Use the config.json that came with the model.",
        )
    return data


def _first_int(data: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def hf_shape(key: str, given: str) -> HFShape:
    """The layer and head counts of the ``config.json`` of ``given`` (a folder or the file).

    Raises:
        ConfigError: ``given`` is missing, has no readable ``config.json``, or no layer/head
            counts, named as ``key``.
    """
    data = _read_config(key, given)
    text = data.get("text_config")  # multimodal configs keep the language model's shape here
    shape_of = text if isinstance(text, dict) else data
    layers = _first_int(shape_of, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first_int(shape_of, "num_attention_heads", "n_head", "num_heads")
    if layers is None or heads is None:
        raise ConfigError(
            key,
            given,
            problem=f"{key} = {given!r}: its config.json has no layer or head count.",
            hint="Use the config.json that came with the model.",
        )
    return HFShape(
        model_type=data["model_type"],
        n_layer=layers,
        n_head=heads,
        max_positions=_first_int(shape_of, "max_position_embeddings", "n_positions"),
        vocab_size=_first_int(shape_of, "vocab_size"),
        n_kv_head=_first_int(shape_of, "num_key_value_heads", "multi_query_group_num"),
    )


def _shards(index: Path) -> list[str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        return sorted(set(data["weight_map"].values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return []


def check_model_folder(given: str) -> HFShape:
    """Check that ``model.pretrained`` is a complete Hugging Face model folder: a
    ``config.json`` with an architecture, and weights (every shard its index names).

    Raises:
        ConfigError: naming ``model.pretrained``, what is missing and how to fix it.
    """
    key = "model.pretrained"
    path = Path(given).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(key, given, problem=f"{key} = {given!r} is a file, not a model folder.")
    shape = hf_shape(key, given)
    found = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not found:
        raise ConfigError(
            key,
            given,
            problem=f"{key} = {given!r}: the folder has a config.json but no weights (none of "
            f"{', '.join(WEIGHT_FILES)}).",
            hint="Copy the weight files too, or use model.config to train this architecture "
            "from scratch.",
        )
    if found[0].endswith(".index.json"):
        shards = _shards(path / found[0])
        missing = [s for s in shards if not (path / s).is_file()]
        if not shards or missing:
            what = f"shards {', '.join(missing[:4])} are missing" if missing else "it is damaged"
            raise ConfigError(
                key,
                given,
                problem=f"{key} = {given!r}: the weight index {found[0]} lists the weight "
                f"shards, but {what}.",
                hint="Copy the complete model folder.",
            )
    return shape


def check_tokenizer_folder(given: str) -> None:
    """Check that ``data.tokenizer`` names a folder with Hugging Face tokenizer files.

    Raises:
        ConfigError: naming ``data.tokenizer``.
    """
    path = Path(given).expanduser()
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            "data.tokenizer",
            given,
            problem=f"data.tokenizer = {given!r} is not 'char', 'bpe' or a folder with Hugging "
            f"Face tokenizer files ({', '.join(TOKENIZER_FILES)}).",
            hint="Pass 'char', 'bpe', or the model folder that holds its tokenizer.",
        )


def tokenizer_size(folder: str) -> int | None:
    """The number of ids a folder's ``tokenizer.json`` produces (its largest id + 1, added
    tokens included); ``None`` without a readable ``tokenizer.json``."""
    file = Path(folder).expanduser() / "tokenizer.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1 if ids else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def check_vocabulary(tokenizer: str, shape: HFShape, key: str, given: str) -> None:
    """Refuse a tokenizer with ids the model has no embedding row for (checked from the files;
    the worker checks again with the loaded tokenizer).

    Raises:
        ConfigError: naming ``data.tokenizer`` and ``key``.
    """
    size = tokenizer_size(tokenizer)
    if size is None or shape.vocab_size is None or size <= shape.vocab_size:
        return
    raise ConfigError(
        "data.tokenizer",
        tokenizer,
        problem=f"the tokenizer {tokenizer!r} (data.tokenizer) has {size} ids but {key} = "
        f"{given!r} has only {shape.vocab_size} embedding rows (vocab_size), so some tokens "
        "have no embedding: the tokenizer and the model do not belong together.",
        hint="Use the tokenizer the model was trained with (leave data.tokenizer out to use the "
        "model folder's).",
    )
