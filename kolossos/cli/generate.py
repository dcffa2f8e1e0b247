"""``kolossos generate RUN_DIR|HF_DIR --prompt TEXT``: sample text from a ``kolossos train``
run's checkpoint or from a Hugging Face model folder (an export, or any local causal LM).

The sampling options default to the run's ``sample`` section (for a Hugging Face folder, to the
section's defaults); the flags override them. The same seed gives the same text.

Example::

    kolossos generate runs/tiny-llama-finetune --prompt "ROMEO." --tokens 50
    kolossos generate exported/ --prompt "ROMEO." --temperature 0.7 --top_k 10
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

PROG = "kolossos generate"


def build_parser() -> argparse.ArgumentParser:
    """The ``kolossos generate`` argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate text from a kolossos train run folder (its latest checkpoint, or "
        "--step's) or a local Hugging Face model folder.",
    )
    p.add_argument("source", metavar="RUN_DIR|HF_DIR", help="a run folder or a model folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=int, default=None, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    p.add_argument("--top_k", "--top-k", type=int, default=None, help="sample among the k best")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the run's)")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step")
    return p


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, int, int]:
    """``(model, tokenizer, sample section, context length, seed)`` of the source."""
    from kolossos.train.config import SampleSection
    from kolossos.train.export import load_run_model
    from kolossos.train.hf_files import check_model_folder
    from kolossos.train.hf_import import transformers_module as _transformers
    from kolossos.train.hf_model import load_hf_tokenizer

    source = Path(args.source)
    if (source / "checkpoints").is_dir():
        run = load_run_model(source, args.step)
        return (
            run.model,
            run.tokenizer,
            run.config.sample,
            run.config.model.block_size,
            run.config.seed,
        )
    if args.step is not None:
        raise ValueError("--step selects a run's checkpoint; the source is not a run folder")
    shape = check_model_folder(args.source)
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source), local_files_only=True, trust_remote_code=False
    )
    model.eval()
    block = shape.max_positions or 1024
    return model, load_hf_tokenizer(args.source, "HF_DIR"), SampleSection(), block, 1024


def main(argv: list[str]) -> int:
    """Run ``kolossos generate``; 0 after printing the text, 2 for a usage or input error."""
    import torch

    from kolossos.train.errors import ConfigError
    from kolossos.train.hf_model import eos_of
    from kolossos.train.model import generate

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    try:
        model, tokenizer, sample, block, seed = _load(args)
        changes = {
            k: v
            for k, v in (("tokens", args.tokens), ("temperature", args.temperature),
                         ("top_k", args.top_k), ("prompt", args.prompt))
            if v is not None
        }  # fmt: skip
        sample = dataclasses.replace(sample, **changes)
        prompt = tokenizer.encode(sample.prompt)
        if not prompt:
            raise ConfigError("--prompt", args.prompt, "text of at least one token")
    except (ConfigError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    with torch.inference_mode():
        chosen = seed if args.seed is None else args.seed
        ids = generate(model, prompt, sample, block, chosen, eos_of(tokenizer))
    print(sample.prompt + tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
