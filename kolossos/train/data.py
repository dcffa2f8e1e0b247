"""The corpus, its tokenizer, and the batches of every step.

Batches are a pure function of ``(seed, step)``: the global batch of step ``s`` is a set of
random windows drawn from a generator seeded by ``(seed, s)``, and data-parallel rank ``r`` takes
rows ``r * per_rank ...`` of it, micro-batch by micro-batch. So a resumed run sees exactly the
batches the uninterrupted run would have seen, and the global batch does not depend on how many
processes share it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kolossos.train.config import DataSection
from kolossos.train.errors import ConfigError
from kolossos.train.state_files import TOKENIZER_HINT, CheckpointFileError, read_tokenizer_file

__all__ = [
    "BPETokenizer",
    "CharTokenizer",
    "Corpus",
    "Tokenizer",
    "bundled_corpus",
    "corpus_path",
    "load_corpus",
    "make_tokenizer",
    "read_corpus_text",
    "saved_chars",
    "split_point",
    "stream_seed",
]


def bundled_corpus() -> Path:
    """The path of the bundled Shakespeare text (see ``kolossos/data/README.md``)."""
    return Path(__file__).resolve().parents[1] / "data" / "shakespeare.txt"


def stream_seed(seed: int, stream: str, step: int = 0) -> int:
    """A 63-bit seed for one independent random stream, e.g. ``("train", step)``."""
    digest = hashlib.blake2b(f"{seed}:{stream}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""


class CharTokenizer:
    """One token per distinct character of the corpus (ids in sorted character order)."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer of the characters in ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``.

        Raises:
            ValueError: a character that the corpus does not contain.
        """
        missing = sorted(set(text) - set(self._ids))
        if missing:
            raise ValueError(f"characters {''.join(missing)!r} are not in the corpus vocabulary")
        return [self._ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""
        return "".join(self.chars[i] for i in ids)

    def to_json(self) -> dict[str, Any]:
        """A JSON description that :func:`_load_tokenizer` reads back."""
        return {"kind": "char", "chars": self.chars}


class BPETokenizer:
    """A byte-level BPE tokenizer from the ``tokenizers`` package."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    @staticmethod
    def _module() -> Any:
        try:
            import tokenizers
        except ModuleNotFoundError:
            raise ConfigError(
                "data.tokenizer",
                "bpe",
                "'char', or 'bpe' with the 'tokenizers' package",
                hint="Install it: pip install 'kolossos[hf]' (or pip install tokenizers).",
            ) from None
        return tokenizers

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Train a tokenizer with ``vocab_size`` ids on ``text`` (deterministic, seconds)."""
        tokenizers = cls._module()
        bpe = tokenizers.ByteLevelBPETokenizer()
        bpe.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False)
        return cls(bpe._tokenizer)

    @classmethod
    def from_str(cls, data: str) -> BPETokenizer:
        """Load a tokenizer saved by :meth:`to_str`."""
        return cls(cls._module().Tokenizer.from_str(data))

    def to_str(self) -> str:
        """The tokenizer as ``tokenizers`` JSON."""
        return str(self.backend.to_str())

    @property
    def vocab_size(self) -> int:
        """Number of ids (the 256 bytes plus merges)."""
        return int(self.backend.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``."""
        return list(self.backend.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""
        return str(self.backend.decode(ids))


def corpus_path(section: DataSection) -> Path:
    """The corpus file of ``section`` (the bundled one for ``path=None``)."""
    return bundled_corpus() if section.path is None else Path(section.path).expanduser()


def split_point(n_tokens: int, val_fraction: float) -> int:
    """Tokens of a corpus of ``n_tokens`` that go to training (the rest is validation)."""
    return int(n_tokens * (1 - val_fraction))


def saved_chars(saved: Path) -> str | None:
    """The characters of a run's saved character tokenizer; ``None`` without one (no file yet,
    or a BPE tokenizer)."""
    if not saved.is_file():
        return None
    data = read_tokenizer_file(saved)  # checked JSON: a damaged file is a CheckpointFileError
    return data["chars"] if data["kind"] == "char" else None


def read_corpus_text(section: DataSection) -> tuple[str, str]:
    """The text of the corpus and its path.

    Raises:
        ConfigError: the file cannot be read as UTF-8 text (named as ``data.path``).
    """
    path = corpus_path(section)
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "data.path",
            section.path,
            "a readable UTF-8 text file",
            hint=f"Reading {str(path)!r} failed: {exc}.",
        ) from None


def make_tokenizer(section: DataSection, text: str, saved: Path) -> Tokenizer:
    """Load the run's tokenizer from ``saved``, or build it from ``text`` and save it there."""
    if saved.is_file():
        data = read_tokenizer_file(saved)  # checked JSON: never code
        if data["kind"] == "char":
            return CharTokenizer(data["chars"])
        try:
            return BPETokenizer.from_str(data["tokenizer"])
        except ConfigError:  # the 'tokenizers' package is missing
            raise
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed model
            raise CheckpointFileError(
                saved, f"not a valid 'tokenizers' BPE model: {exc}", TOKENIZER_HINT
            ) from None
    tok: CharTokenizer | BPETokenizer
    if section.tokenizer == "char":
        tok = CharTokenizer.from_text(text)
        payload = tok.to_json()
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tok = BPETokenizer.train(text, section.vocab_size)
        payload = {"kind": "bpe", "tokenizer": tok.to_str()}
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(f".{saved.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    os.replace(tmp, saved)
    return tok


@dataclass
class Corpus:
    """Token ids split into a training and a validation part, and the tokenizer."""

    train_ids: torch.Tensor
    """Training tokens (1-D, int64)."""
    val_ids: torch.Tensor
    """Validation tokens (1-D, int64): the end of the text."""
    tokenizer: Tokenizer
    """Turns text into ids and back."""
    source: str
    """The corpus file."""

    @property
    def n_train_tokens(self) -> int:
        """Tokens of the training part."""
        return len(self.train_ids)

    @property
    def n_val_tokens(self) -> int:
        """Tokens of the validation part."""
        return len(self.val_ids)

    def _windows(self, ids: torch.Tensor, offsets: torch.Tensor, block: int) -> torch.Tensor:
        return ids[offsets[:, None] + torch.arange(block)]

    def train_batch(self, step: int, *, seed: int, batch_size: int, block: int) -> torch.Tensor:
        """The global batch of ``step``: ``batch_size`` windows of ``block`` tokens."""
        gen = torch.Generator().manual_seed(stream_seed(seed, "train", step))
        offsets = torch.randint(0, len(self.train_ids) - block + 1, (batch_size,), generator=gen)
        return self._windows(self.train_ids, offsets, block)

    def val_batches(self, *, seed: int, count: int, batch_size: int, block: int) -> torch.Tensor:
        """``count`` fixed validation batches, shaped ``(count, batch_size, block)``."""
        gen = torch.Generator().manual_seed(stream_seed(seed, "val"))
        offsets = torch.randint(
            0, len(self.val_ids) - block + 1, (count * batch_size,), generator=gen
        )
        return self._windows(self.val_ids, offsets, block).view(count, batch_size, block)


def load_corpus(section: DataSection, block: int, tokenizer_file: Path) -> Corpus:
    """Read and tokenize the corpus; the tokenizer is cached in ``tokenizer_file``.

    Call it on one rank first when the file may not exist yet (BPE training is slow-ish), then on
    the others, so that every rank uses the same tokenizer.

    Raises:
        ConfigError: an unreadable file, or a corpus too short for ``block``-token windows.
    """
    text, source = read_corpus_text(section)
    tokenizer = make_tokenizer(section, text, tokenizer_file)
    try:
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    except ValueError as exc:
        raise ConfigError(
            "data.path",
            section.path,
            "the corpus the run's tokenizer was built from",
            hint=f"{exc} (tokenizer saved in {tokenizer_file}); start a new run name.",
        ) from None
    split = split_point(len(ids), section.val_fraction)
    train, val = ids[:split], ids[split:]
    if min(len(train), len(val)) < block:
        raise ConfigError(
            "model.block_size",
            block,
            f"at most {min(len(train), len(val))} tokens for this corpus and data.val_fraction",
            hint=f"{source} has {len(ids)} tokens: {len(train)} for training, {len(val)} for "
            "validation; use a longer text or a shorter block_size.",
        )
    return Corpus(train_ids=train, val_ids=val, tokenizer=tokenizer, source=source)
