"""The GPT tutorial's ``WebtextDataset``: loose JSON (one ``{"text": ...}`` object per line)
tokenised with a GPT-2 tokenizer, padded and truncated to ``seq_len``, cached next to the file as
``gpt_webtext_{seq_len}.pt``; an item is ``({'input_ids', 'attention_mask'}, input_ids)``.

There is no model hub here: :func:`gpt2_tokenizer` builds ``transformers.GPT2Tokenizer`` from a
local ``vocab.json`` / ``merges.txt`` (a real GPT-2 vocabulary in ``vocab_dir`` or
``$KOLOSSOS_GPT2_VOCAB``), else from the 1024-token byte-level BPE vocabulary shipped in
``kolossos/data`` (see its README). :func:`write_sample_webtext` writes a small loose-JSON stand-in
from the bundled Shakespeare text when the real data set is absent.

Example::

    write_sample_webtext("/tmp/webtext/train.json", num_docs=64)
    dataset = WebtextDataset("/tmp/webtext/train.json", seq_len=16)
    data, label = dataset[0]      # data["input_ids"]: [16] int64, label is data["input_ids"]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["WebtextDataset", "gpt2_tokenizer", "write_sample_webtext"]

_DATA = Path(__file__).resolve().parents[2] / "data"
TINY_VOCAB = (_DATA / "gpt2_tiny-vocab.json", _DATA / "gpt2_tiny-merges.txt")
"""The shipped vocabulary (1024 tokens) used when no GPT-2 vocabulary is given."""
VOCAB_ENV = "KOLOSSOS_GPT2_VOCAB"
"""Environment variable naming a directory with GPT-2's ``vocab.json`` and ``merges.txt``."""


def gpt2_tokenizer(vocab_dir: str | os.PathLike[str] | None = None) -> Any:
    """A ``transformers.GPT2Tokenizer`` from local files, ``pad_token = unk_token`` (as the
    tutorial sets it).

    Args:
        vocab_dir: a directory holding ``vocab.json`` and ``merges.txt`` (default:
            ``$KOLOSSOS_GPT2_VOCAB``, else the shipped 1024-token vocabulary).

    Raises:
        ImportError: transformers is not installed.
        FileNotFoundError: ``vocab_dir`` lacks one of the two files.
    """
    try:
        from transformers import GPT2Tokenizer
    except ImportError as err:
        raise ImportError(
            "WebtextDataset needs transformers' GPT2Tokenizer: pip install transformers"
        ) from err
    folder = vocab_dir if vocab_dir is not None else os.environ.get(VOCAB_ENV)
    if folder is not None:
        vocab, merges = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
        missing = [str(p) for p in (vocab, merges) if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"GPT-2 vocabulary directory {folder} lacks {missing}; put GPT-2's vocab.json "
                f"and merges.txt there, or unset {VOCAB_ENV} to use the shipped vocabulary."
            )
    else:
        vocab, merges = TINY_VOCAB
    tokenizer = GPT2Tokenizer(str(vocab), str(merges))
    tokenizer.pad_token = tokenizer.unk_token
    return tokenizer


def _read_texts(path: Path) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path}:{number}: not a JSON object with a 'text' field ({err}); the "
                    'dataset is loose JSON, one {"text": "..."} object per line.'
                ) from err
    if not texts:
        raise ValueError(f"{path} holds no documents (one JSON object per line).")
    return texts


class WebtextDataset(Dataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Tokenised loose-JSON documents, each padded (to the longest, as ``padding=True``) and
    truncated to ``seq_len`` tokens.

    The encoding is cached as ``(seq_len, input_ids, attention_mask)`` in
    ``gpt_webtext_{seq_len}.pt`` next to ``path`` and reused when its ``seq_len`` matches.

    Args:
        path: the loose-JSON file.
        seq_len: the longest sequence (tokens).
        tokenizer: a GPT-2 tokenizer (default :func:`gpt2_tokenizer`).

    Raises:
        FileNotFoundError: ``path`` does not exist (and there is no cache).
        ValueError: a line is not a JSON object with ``"text"``.
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int = 1024, tokenizer: Any = None):
        super().__init__()
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 2.")
        path = Path(path)
        self.cache_path = path.parent / f"gpt_webtext_{seq_len}.pt"
        if self.cache_path.is_file():
            cached_len, data, mask = torch.load(self.cache_path)
            if cached_len == seq_len:
                self.data, self.attention_mask = data, mask
                return
        if not path.is_file():
            raise FileNotFoundError(f"WebtextDataset: no file {path} (loose JSON, one per line).")
        tokenizer = tokenizer if tokenizer is not None else gpt2_tokenizer()
        encoded = tokenizer(
            _read_texts(path), padding=True, truncation=True, max_length=seq_len,
            return_tensors="pt",
        )  # fmt: skip
        self.data, self.attention_mask = encoded["input_ids"], encoded["attention_mask"]
        tmp = self.cache_path.with_name(self.cache_path.name + f".tmp{os.getpid()}")
        torch.save((seq_len, self.data, self.attention_mask), tmp)
        os.replace(tmp, self.cache_path)  # atomic: a concurrent reader sees old or new

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {
            "input_ids": self.data[index],
            "attention_mask": self.attention_mask[index],
        }, self.data[index]


def write_sample_webtext(
    path: str | os.PathLike[str], num_docs: int = 64, words_per_doc: int = 120
) -> Path:
    """Write ``num_docs`` loose-JSON documents of ``words_per_doc`` words, consecutive pieces of
    the bundled Shakespeare text, to ``path`` (atomically; parent directories are created)."""
    words = (_DATA / "shakespeare.txt").read_text(encoding="utf-8").split()
    if num_docs * words_per_doc > len(words):
        raise ValueError(f"num_docs x words_per_doc must be at most {len(words)} words.")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"text": " ".join(words[i * words_per_doc : (i + 1) * words_per_doc])})
        for i in range(num_docs)
    ]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return out
