"""Tokenising many documents, in parallel processes when the data is large.

The documents are cut into contiguous runs of about equal size, each run is tokenised by one
process of a pool (started with ``spawn``: safe whatever threads the parent runs), and the results
are put back in document order. Every document is tokenised on its own, exactly as the serial
path does, so the ids do not depend on the number of processes.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from itertools import chain, pairwise
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "MAX_AUTO_PROCS",
    "PARALLEL_MIN_CHARS",
    "PARALLEL_MIN_CPUS",
    "Ragged",
    "auto_procs",
    "encode_all",
    "encode_documents",
]

#: with ``data.num_proc = None``, data with fewer characters is tokenised in this process (a
#: pool's start-up, 0.7 to 3 s measured here, costs more than it saves below it)
PARALLEL_MIN_CHARS = 16 << 20
#: with ``data.num_proc = None``, a machine with fewer cores tokenises in this process (on 2
#: shared cores the pool measured slower than one process: see docs/getting-started.md)
PARALLEL_MIN_CPUS = 4
#: the most processes ``data.num_proc = None`` starts
MAX_AUTO_PROCS = 8
#: runs of documents per process (more runs even out documents of unequal length)
_RUNS_PER_PROC = 4

_worker_tokenizer: Any = None


class Ragged(NamedTuple):
    """The ids of many texts in one array: text ``i`` is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray
    """Every id, text after text (int32)."""
    offsets: np.ndarray
    """Where each text starts, and the total at the end (int64, one longer than the texts)."""

    @classmethod
    def of(cls, rows: list[list[int]]) -> Ragged:
        """Pack lists of ids."""
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(offsets[-1]))
        return cls(flat, offsets)

    @classmethod
    def join(cls, parts: list[Ragged]) -> Ragged:
        """The texts of ``parts`` one after the other."""
        ids = np.concatenate([p.ids for p in parts]) if parts else np.zeros(0, np.int32)
        offsets, base = [np.zeros(1, dtype=np.int64)], 0
        for part in parts:
            offsets.append(part.offsets[1:] + base)
            base += int(part.offsets[-1])
        return cls(ids, np.concatenate(offsets))

    def take(self, start: int, stop: int) -> Ragged:
        """Texts ``start .. stop - 1``."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Ragged(self.ids[lo:hi], self.offsets[start : stop + 1] - lo)

    @property
    def lengths(self) -> np.ndarray:
        """Ids per text."""
        return np.diff(self.offsets)

    def rows(self) -> list[list[int]]:
        """The ids as lists, one per text."""
        return [self.ids[a:b].tolist() for a, b in pairwise(self.offsets.tolist())]


def encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """The ids of every text in this process (a batched call for a Hugging Face tokenizer)."""
    from kolossos.train.hf_model import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) if t else [] for t in texts]


def auto_procs(total_chars: int, cpus: int | None = None) -> int:
    """Processes for ``data.num_proc = None``: one below :data:`PARALLEL_MIN_CHARS`
    characters or :data:`PARALLEL_MIN_CPUS` cores, else the cores (at most
    :data:`MAX_AUTO_PROCS`)."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    if total_chars < PARALLEL_MIN_CHARS or cpus < PARALLEL_MIN_CPUS:
        return 1
    return min(cpus, MAX_AUTO_PROCS)


def _portable(tokenizer: Any) -> tuple[str, Any] | None:
    """What a pool process needs to tokenise like ``tokenizer`` without importing torch: the
    Hugging Face tokenizer object, or the ``tokenizers`` model of the run's BPE; ``None`` for the
    character tokenizer (a dictionary look-up per character, always tokenised in this process)."""
    from kolossos.train.data import BPETokenizer
    from kolossos.train.hf_model import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return "hf", tokenizer.backend
    if isinstance(tokenizer, BPETokenizer):
        return "bpe", tokenizer.backend
    return None


def _init_worker(portable: tuple[str, Any]) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: no oversubscription
    _worker_tokenizer = portable


def _encode_run(texts: list[str]) -> Ragged:
    """A pool process's part, computed as :func:`encode_all` (``HFTokenizer.encode_batch``,
    ``BPETokenizer.encode``) does."""
    kind, backend = _worker_tokenizer
    if kind == "hf":
        rows = list(backend(texts, add_special_tokens=False)["input_ids"]) if texts else []
    else:
        rows = [list(backend.encode(t).ids) if t else [] for t in texts]
    return Ragged.of(rows)


def _runs(texts: list[str], count: int) -> list[list[str]]:
    """``texts`` cut into at most ``count`` contiguous runs of about equal characters."""
    total = sum(len(t) for t in texts)
    target = max(1, -(-total // count))
    runs: list[list[str]] = [[]]
    size = 0
    for text in texts:
        if size >= target and len(runs) < count:
            runs.append([])
            size = 0
        runs[-1].append(text)
        size += len(text)
    return runs


def encode_documents(
    tokenizer: Any, prompts: list[str], texts: list[str], num_proc: int | None = None
) -> tuple[Ragged, Ragged]:
    """The ids of every prompt and every text, in order.

    Args:
        tokenizer: a trainer tokenizer (the character tokenizer always runs in this process).
        prompts: each document's prompt (``""`` for none).
        texts: each document's text.
        num_proc: processes to use; ``None`` chooses with :func:`auto_procs`; ``1`` tokenises
            in this process. A pool starts its processes with ``spawn``, which imports the
            main module again: a script calling this needs the ``if __name__ == "__main__":``
            guard.
    """
    together = prompts + texts
    procs = auto_procs(sum(len(t) for t in together)) if num_proc is None else num_proc
    portable = _portable(tokenizer) if procs > 1 and len(together) > 1 else None
    if portable is None:
        ids = Ragged.of(encode_all(tokenizer, together))
    else:
        runs = _runs(together, procs * _RUNS_PER_PROC)
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=min(procs, len(runs)),
            mp_context=context,
            initializer=_init_worker,
            initargs=(portable,),
        ) as pool:
            ids = Ragged.join(list(pool.map(_encode_run, runs)))
    return ids.take(0, len(prompts)), ids.take(len(prompts), len(together))
