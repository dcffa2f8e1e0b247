"""Hugging Face causal LMs from local folders: the pretrained model (``model.pretrained``), a
fresh one of any architecture (``model.config``), and the tokenizer from a folder.

Nothing is downloaded (``local_files_only=True``) and no code from a folder runs
(``trust_remote_code=False``; weights are read by safetensors, or by ``torch.load`` with
``weights_only=True``, which transformers uses for ``.bin`` files).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from kolossos.train.config import ModelSection
from kolossos.train.errors import ConfigError
from kolossos.train.hf_import import enable_activation_checkpointing
from kolossos.train.hf_import import transformers_module as _transformers

__all__ = ["HFTokenizer", "build_hf_model", "eos_of", "hf_config", "load_hf_tokenizer"]

#: the files a tokenizer is made of (besides any with "token" in the name)
_TOKENIZER_FILES = ("vocab.json", "merges.txt", "vocab.txt", "spiece.model")


class HFTokenizer:
    """A Hugging Face tokenizer behind the trainer's :class:`~kolossos.train.data.Tokenizer`
    protocol (no special tokens added; ``len(tokenizer)`` ids)."""

    def __init__(self, backend: Any, folder: str) -> None:
        self.backend = backend
        self.folder = folder

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return len(self.backend)

    @property
    def eos_id(self) -> int | None:
        """The end-of-text id that separates packed documents (``None`` when it has none)."""
        eos = self.backend.eos_token_id
        return None if eos is None else int(eos)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``."""
        return list(self.backend(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of many texts at once (the fast tokenizers run these in parallel)."""
        if not texts:
            return []
        return [list(ids) for ids in self.backend(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""
        return str(self.backend.decode(ids))

    def fingerprint(self) -> str:
        """A digest that changes whenever the tokenizer's files (vocabulary, rules) change."""
        digest = hashlib.blake2b(digest_size=16)
        folder = Path(self.folder)
        for file in sorted(folder.iterdir()):
            if file.is_file() and (file.name in _TOKENIZER_FILES or "token" in file.name):
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return digest.hexdigest()


def eos_of(tokenizer: object) -> int | None:
    """The end-of-text id of a trainer tokenizer (``None`` for the run's own ones)."""
    return tokenizer.eos_id if isinstance(tokenizer, HFTokenizer) else None


def load_hf_tokenizer(folder: str, key: str = "data.tokenizer") -> HFTokenizer:
    """The tokenizer saved in ``folder`` (``AutoTokenizer``, local files only, no remote code).

    Raises:
        ConfigError: the folder holds no tokenizer transformers can read, named as ``key``.
    """
    transformers = _transformers()
    path = str(Path(folder).expanduser())
    try:
        backend = transformers.AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(
            key,
            folder,
            problem=f"{key} = {folder!r}: no tokenizer could be loaded from it ({exc}).",
            hint="The folder needs the tokenizer files the model came with (tokenizer.json, or "
            "tokenizer.model and tokenizer_config.json).",
        ) from None
    return HFTokenizer(backend, path)


def hf_config(section: ModelSection) -> Any:
    """The ``PretrainedConfig`` of ``model.pretrained`` or ``model.config`` (context length and
    cache settings for training applied).

    Raises:
        ConfigError: transformers does not know the architecture, or ``model.block_size`` is
            longer than its position encoding allows.
    """
    transformers = _transformers()
    key = "model.pretrained" if section.pretrained is not None else "model.config"
    given = section.hf_source
    assert given is not None
    path = Path(given).expanduser()
    try:
        if path.is_dir():
            config = transformers.AutoConfig.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False
            )
        else:
            raw = transformers.PretrainedConfig.get_config_dict(str(path))[0]
            config = transformers.AutoConfig.for_model(**raw)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            key,
            given,
            problem=f"{key} = {given!r}: transformers cannot build this architecture ({exc}).",
            hint="Upgrade transformers, or use a model family it knows; remote code is never run.",
        ) from None
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    if limit and section.block_size > limit:
        raise ConfigError(
            "model.block_size",
            section.block_size,
            f"at most {limit} (the position limit of {given})",
        )
    config.use_cache = False
    return config


def _check_causal(transformers: Any, config: Any, key: str, given: str) -> None:
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in mapping:
        raise ConfigError(
            key,
            given,
            problem=f"{key} = {given!r} is a {config.model_type!r} model, which is not a causal "
            "language model transformers knows (AutoModelForCausalLM).",
            hint="Train a decoder model (LLaMA, Qwen, Mistral, GPT-2, OPT, ...).",
        )


def build_hf_model(section: ModelSection, vocab_size: int, *, load_weights: bool = True) -> Any:
    """The model of ``model.pretrained`` (its weights) or ``model.config`` (fresh weights from
    torch's global RNG: seed first), in fp32.

    Args:
        section: the model section (``pretrained`` or ``config`` set).
        vocab_size: the tokenizer's ids; the model must have an embedding row for each. A fresh
            model from a config gets exactly as many when its config has fewer.
        load_weights: ``False`` builds the architecture only (to load a checkpoint into).

    Raises:
        ConfigError: an unknown architecture, or a tokenizer with ids the model has no
            embedding for (naming ``data.tokenizer`` and the model key).
    """
    transformers = _transformers()
    key = "model.pretrained" if section.pretrained is not None else "model.config"
    given = section.hf_source
    assert given is not None
    config = hf_config(section)
    _check_causal(transformers, config, key, given)
    if section.pretrained is None and (config.vocab_size or 0) < vocab_size:
        config.vocab_size = vocab_size
    if (config.vocab_size or 0) < vocab_size:
        raise ConfigError(
            "data.tokenizer",
            problem=f"the tokenizer has {vocab_size} ids but {key} = {given!r} has only "
            f"{config.vocab_size} embedding rows (vocab_size), so some tokens have no embedding: "
            "the tokenizer and the model do not belong together.",
            hint="Use the tokenizer the model was trained with (leave data.tokenizer out to use "
            "the model folder's).",
        )
    auto = transformers.AutoModelForCausalLM
    if section.pretrained is not None and load_weights:
        model = auto.from_pretrained(
            str(Path(given).expanduser()),
            config=config,
            local_files_only=True,
            trust_remote_code=False,
            dtype=torch.float32,
        )
    else:
        model = auto.from_config(config, trust_remote_code=False, dtype=torch.float32)
    if section.activation_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    built: nn.Module = model
    return built
