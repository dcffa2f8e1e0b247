"""Documents tokenised once into a memory-mapped token file, packed into fixed-length
sequences, and shuffled per epoch in a way that resumes exactly.

The token file lives in ``<output_dir>/.token_cache/<key>/`` where the key digests the data
files, the format and its fields, and the tokenizer: another run on the same data and tokenizer
reads it instead of tokenising again; a change of either makes a new one. Documents are joined
with the tokenizer's end-of-text token (when it has one) and cut into ``block_size`` sequences
(the tail shorter than one sequence is dropped). The last ``val_fraction`` of the sequences is
held out for validation.

Instruction records are tokenised as prompt then response (then end-of-text); the prompt's
positions get the label ``-100``, so the model's loss covers only the response.

The training batches are a pure function of ``(seed, step)``: the sequences are visited epoch
by epoch, each epoch in the order of a permutation seeded by ``(seed, epoch)``, and step ``s``
takes the next ``batch_size`` of them. A resumed run therefore sees exactly the batches of the
uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kolossos.train.config import DataSection
from kolossos.train.data import stream_seed
from kolossos.train.documents import Document
from kolossos.train.errors import ConfigError

__all__ = [
    "IGNORE_INDEX",
    "PackedCorpus",
    "cache_key",
    "load_packed",
    "run_tokenizer",
    "token_cache",
    "tokenize_documents",
]

#: the label of a position the loss ignores (the convention of torch's cross-entropy and HF)
IGNORE_INDEX = -100
_META = "meta.json"


def tokenize_documents(
    docs: list[Document], tokenizer: Any, eos: int | None, num_proc: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The token stream of ``docs`` and its loss mask (1: trained on, 0: a prompt token).

    Each document is its prompt's tokens, its text's tokens and ``eos`` (if not ``None``).
    ``num_proc`` processes tokenise (``None``: automatic, see
    :func:`~kolossos.train.tokenize_pool.encode_documents`); the result does not depend on it.
    """
    from kolossos.train.tokenize_pool import encode_documents

    prompts, texts = encode_documents(
        tokenizer, [d.prompt for d in docs], [d.text for d in docs], num_proc
    )
    p_len, t_len = prompts.lengths, texts.lengths
    doc_len = p_len + t_len + (0 if eos is None else 1)
    starts = np.zeros(len(docs), dtype=np.int64)
    np.cumsum(doc_len[:-1], out=starts[1:])
    ids = np.empty(int(doc_len.sum()), dtype=np.int32)
    mask = np.ones(len(ids), dtype=np.uint8)
    at_prompt = np.arange(len(prompts.ids)) + np.repeat(starts - prompts.offsets[:-1], p_len)
    ids[at_prompt], mask[at_prompt] = prompts.ids, 0
    at_text = np.arange(len(texts.ids)) + np.repeat(starts + p_len - texts.offsets[:-1], t_len)
    ids[at_text] = texts.ids
    if eos is not None:
        ids[starts + p_len + t_len] = eos
    return ids, mask


def cache_key(section: DataSection, data_digest: str, tokenizer_digest: str) -> str:
    """The token cache's folder name for this data, format and tokenizer."""
    fields = (
        section.format,
        section.text_field,
        section.prompt_field,
        section.response_field,
        section.instruction,
    )
    text = json.dumps([data_digest, tokenizer_digest, *fields])
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def token_cache(root: Path, key: str, build: Any) -> tuple[np.ndarray, np.ndarray]:
    """The memory-mapped ``(ids, mask)`` of cache ``key`` under ``root``; ``build()`` makes them
    when the cache does not have them yet (written under a temporary name, then renamed)."""
    folder = root / key
    if not (folder / _META).is_file():
        ids, mask = build()
        tmp = root / f".{key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ids.tofile(tmp / "ids.bin")
        mask.tofile(tmp / "mask.bin")
        (tmp / _META).write_text(json.dumps({"tokens": len(ids)}), encoding="utf-8")
        try:
            os.replace(tmp, folder)
        except OSError:  # another job wrote it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    count = json.loads((folder / _META).read_text(encoding="utf-8"))["tokens"]
    if count == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8)
    ids_mm = np.memmap(folder / "ids.bin", dtype=np.int32, mode="r", shape=(count,))
    mask_mm = np.memmap(folder / "mask.bin", dtype=np.uint8, mode="r", shape=(count,))
    return ids_mm, mask_mm


@dataclass
class PackedCorpus:
    """Packed sequences of a tokenised data set, with the trainer's batch interface (batches
    are ``(input_ids, labels)`` pairs)."""

    ids: np.ndarray
    """The token stream (memory-mapped, int32)."""
    mask: np.ndarray
    """1 where the token is trained on, 0 for prompt tokens."""
    block: int
    """Tokens per sequence."""
    n_train: int
    """Sequences for training (the first ones)."""
    n_val: int
    """Sequences held out for validation (the last ones)."""
    tokenizer: Any
    """Turns text into ids and back."""
    source: str
    """The data path."""

    @classmethod
    def pack(
        cls, ids: np.ndarray, mask: np.ndarray, block: int, val_fraction: float, **kw: Any
    ) -> PackedCorpus:
        """Cut the stream into ``block``-token sequences and split them.

        Raises:
            ConfigError: fewer tokens than two sequences (one to train on, one to validate).
        """
        total = len(ids) // block
        n_val = max(1, round(total * val_fraction))
        if total - n_val < 1:
            raise ConfigError(
                "model.block_size",
                block,
                problem=f"the data set has {len(ids)} tokens, which make {total} sequence(s) of "
                f"model.block_size = {block}; at least 2 are needed (one to train on, one held "
                "out for validation).",
                hint="Use more data or a shorter model.block_size.",
            )
        return cls(ids=ids, mask=mask, block=block, n_train=total - n_val, n_val=n_val, **kw)

    @property
    def n_train_tokens(self) -> int:
        """Tokens in the training sequences."""
        return self.n_train * self.block

    @property
    def n_val_tokens(self) -> int:
        """Tokens in the validation sequences."""
        return self.n_val * self.block

    def _rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = index.numpy().astype(np.int64)[:, None] * self.block + np.arange(self.block)
        ids = torch.from_numpy(np.asarray(self.ids[starts], dtype=np.int64))
        keep = torch.from_numpy(np.asarray(self.mask[starts]).astype(bool))
        return ids, ids.masked_fill(~keep, IGNORE_INDEX)

    def sequence(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``index`` (training ones first) as ``(input_ids, labels)``."""
        ids, labels = self._rows(torch.tensor([index]))
        return ids[0], labels[0]

    def train_indices(self, step: int, *, seed: int, batch_size: int) -> torch.Tensor:
        """Which training sequences step ``step`` (from 1) trains on."""
        flat = (step - 1) * batch_size + torch.arange(batch_size)
        epochs, pos = flat // self.n_train, flat % self.n_train
        out = torch.empty(batch_size, dtype=torch.int64)
        for epoch in epochs.unique().tolist():
            gen = torch.Generator().manual_seed(stream_seed(seed, "epoch", int(epoch)))
            order = torch.randperm(self.n_train, generator=gen)
            here = epochs == epoch
            out[here] = order[pos[here]]
        return out

    def train_batch(
        self, step: int, *, seed: int, batch_size: int, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``(input_ids, labels)``, each ``(batch_size, block)``."""
        assert block == self.block, "packed at another block size"
        return self._rows(self.train_indices(step, seed=seed, batch_size=batch_size))

    def val_batches(
        self, *, seed: int, count: int, batch_size: int, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` fixed validation batches (the held-out sequences in order, repeated when
        there are fewer): ``(input_ids, labels)``, each ``(count, batch_size, block)``."""
        del seed  # the held-out sequences are visited in order
        assert block == self.block, "packed at another block size"
        index = self.n_train + torch.arange(count * batch_size) % self.n_val
        ids, labels = self._rows(index)
        return ids.view(count, batch_size, block), labels.view(count, batch_size, block)


def _fingerprint(tokenizer: Any) -> str:
    from kolossos.train.data import BPETokenizer, CharTokenizer
    from kolossos.train.hf_model import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return "hf:" + tokenizer.fingerprint()
    if isinstance(tokenizer, CharTokenizer):
        return "char:" + tokenizer.chars
    assert isinstance(tokenizer, BPETokenizer)
    return "bpe:" + hashlib.blake2b(tokenizer.to_str().encode(), digest_size=16).hexdigest()


def run_tokenizer(section: DataSection, docs: list[Document], saved: Path) -> Any:
    """The tokenizer of ``data.tokenizer``: a Hugging Face folder's, or the run's character or
    BPE tokenizer (built from the documents at the first start and saved in ``saved``)."""
    from kolossos.train.config import TOKENIZERS
    from kolossos.train.data import make_tokenizer
    from kolossos.train.hf_model import load_hf_tokenizer

    if section.tokenizer not in TOKENIZERS:
        return load_hf_tokenizer(section.tokenizer)
    text = "\n".join(d.prompt + d.text for d in docs)
    return make_tokenizer(section, text, saved)


def load_packed(
    section: DataSection, block: int, saved_tokenizer: Path, cache_root: Path
) -> PackedCorpus:
    """Read, tokenise (or find in the cache) and pack ``data.path``.

    Call it on one rank first (it may write the cache and the tokenizer), then on the others.

    Raises:
        ConfigError: unreadable or empty data, a line without its field, or too few tokens.
    """
    from kolossos.train.documents import data_digest, data_files, read_documents
    from kolossos.train.hf_model import eos_of

    files = data_files(section)
    docs: list[Document] | None = None
    if section.tokenizer in ("char", "bpe") and not saved_tokenizer.is_file():
        docs = read_documents(section)  # the run's tokenizer is built from them
    tokenizer = run_tokenizer(section, docs or [], saved_tokenizer)
    eos = eos_of(tokenizer)
    key = cache_key(section, data_digest(files), _fingerprint(tokenizer))

    def build() -> tuple[np.ndarray, np.ndarray]:
        return tokenize_documents(docs or read_documents(section), tokenizer, eos, section.num_proc)

    ids, mask = token_cache(cache_root, key, build)
    return PackedCorpus.pack(
        ids, mask, block, section.val_fraction, tokenizer=tokenizer, source=str(section.path)
    )
