"""Tokenising a generated corpus in one process and in a process pool (``data.num_proc``).

The corpus is ``--mb`` MiB of documents of 20-400 words drawn from a fixed word list (seeded).
For each tokenizer (the run's own BPE trained on the corpus' first MiB, and the tokenizer of a
tiny local LLaMA folder, a Hugging Face fast tokenizer called in batches), it times
:func:`kolossos.train.tokenize_pool.encode_documents` with each ``--procs`` value (best of
``--reps``, pool start-up included), checks that every value gives the serial ids, and prints
one line per run and a JSON line.

Usage::

    python -m benchmarks.tokenize_parallel --mb 8 --procs 1 2
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

WORDS = [
    "the",
    "king",
    "queen",
    "lord",
    "love",
    "death",
    "night",
    "day",
    "sword",
    "crown",
    "heart",
    "blood",
    "speak",
    "answer",
    "thou",
    "thee",
    "shall",
    "would",
    "noble",
    "gentle",
    "fortune",
    "heaven",
    "honour",
    "England",
    "France",
    "letter",
    "kingdom",
    "banished",
    "Romeo",
    "Juliet",
    "Hamlet",
    "tomorrow",
    "yesterday,",
    "again;",
    "therefore:",
    "nothing!",
    "wherefore?",
]


def corpus(mb: float, seed: int = 0) -> list[str]:
    """Documents totalling about ``mb`` MiB of text."""
    rng = random.Random(seed)
    docs, size = [], 0
    while size < mb * (1 << 20):
        doc = " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))
        docs.append(doc)
        size += len(doc)
    return docs


def tokenizers(docs: list[str], folder: Path) -> dict[str, Any]:
    """The tokenizers to time."""
    from kolossos.train.data import BPETokenizer
    from kolossos.train.hf_model import load_hf_tokenizer
    from kolossos.train.tiny import make_tiny_checkpoint

    head, size = [], 0
    for doc in docs:
        head.append(doc)
        size += len(doc)
        if size > 1 << 20:
            break
    model = make_tiny_checkpoint(folder / "llama")
    return {
        "bpe": BPETokenizer.train("\n".join(head), 2048),
        "hf-llama": load_hf_tokenizer(str(model)),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print it."""
    from kolossos.train.tokenize_pool import encode_documents

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="corpus size in MiB")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    docs = corpus(args.mb)
    prompts = [""] * len(docs)
    chars = sum(len(d) for d in docs)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, tok in tokenizers(docs, Path(tmp)).items():
            reference = None
            for procs in args.procs:
                best = float("inf")
                for _ in range(args.reps):
                    start = time.perf_counter()
                    _, ids = encode_documents(tok, prompts, docs, procs)
                    best = min(best, time.perf_counter() - start)
                reference = ids if reference is None else reference
                same = all(np.array_equal(a, b) for a, b in zip(ids, reference, strict=True))
                assert same, f"{name}: num_proc={procs} changed the ids"
                tokens = len(ids.ids)
                results.append(
                    {"tokenizer": name, "num_proc": procs, "seconds": round(best, 3),
                     "chars": chars, "tokens": tokens, "docs": len(docs)}
                )  # fmt: skip
                print(f"{name:9s} num_proc={procs}: {best:6.2f} s for {chars / 2**20:.1f} MiB "
                      f"({tokens} tokens, {len(docs)} documents)")  # fmt: skip
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
