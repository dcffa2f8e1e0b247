"""Build the tiny local model and data the Hugging Face example configs train on (nothing can be
downloaded here, so they are made from scratch, in seconds):

    python examples/make_tiny_models.py            # writes runs/tiny-models/

- ``runs/tiny-models/llama/``: a randomly initialised 2-layer LLaMA (hidden size 64) saved with
  ``save_pretrained`` next to a byte-level BPE tokenizer (320 ids) trained on the start of the
  bundled Shakespeare, as a model folder ``model.pretrained`` accepts;
- ``runs/tiny-models/instructions.jsonl``: instruction records made from Shakespeare's lines,
  ``{"prompt": "Complete the line: <first half>\\n", "response": "<second half>"}``.

Then:

    kolossos train examples/configs/llama_tiny_finetune.py
    kolossos train examples/configs/llama_tiny_instruct.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kolossos.train.data import bundled_corpus
from kolossos.train.tiny import make_tiny_checkpoint


def instruction_records(count: int) -> list[dict[str, str]]:
    """``count`` prompt/response pairs: the halves of Shakespeare's longer lines."""
    records = []
    for line in bundled_corpus().read_text(encoding="utf-8").splitlines():
        words = line.split()
        if len(words) >= 6:
            half = len(words) // 2
            prompt = "Complete the line: " + " ".join(words[:half]) + "\n"
            records.append({"prompt": prompt, "response": " ".join(words[half:])})
        if len(records) == count:
            break
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/tiny-models", help="folder to write")
    args = parser.parse_args()
    out = Path(args.out)
    model = make_tiny_checkpoint(out / "llama", family="llama", hidden=64, layers=2, heads=4)
    data = out / "instructions.jsonl"
    lines = [json.dumps(r) for r in instruction_records(2000)]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {model}/ (model and tokenizer) and {data} ({len(lines)} records)")


if __name__ == "__main__":
    main()
