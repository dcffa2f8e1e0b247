"""``kolossos export RUN_DIR [--step N] OUT_DIR``: a ``kolossos train`` checkpoint as a Hugging
Face model folder (``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` load it).

Example::

    kolossos export runs/tiny-llama-finetune exported/
    kolossos export runs/tiny-llama-finetune --step 20 exported-step20/
"""

from __future__ import annotations

import argparse
import sys

PROG = "kolossos export"


def build_parser() -> argparse.ArgumentParser:
    """The ``kolossos export`` argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Write a kolossos train run's checkpoint (the latest complete one, or "
        "--step's) as a Hugging Face model folder with its tokenizer.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder, <output_dir>/<name>")
    p.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) folder to write")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint's step")
    return p


def main(argv: list[str]) -> int:
    """Run ``kolossos export``; 0 when written, 2 for a usage or input error (printed)."""
    from kolossos.train.errors import ConfigError
    from kolossos.train.export import export_run

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    try:
        out = export_run(args.run_dir, args.out_dir, args.step)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {out} (load it with AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
