"""Entry point of ``python -m benchmarks``."""

from __future__ import annotations

import importlib
import sys

from benchmarks.runner import main

#: benchmarks with a command line of their own: ``python -m benchmarks NAME [options]``
STANDALONE = {
    "sequence_parallel": "benchmarks.sequence_parallel",
    "moe": "benchmarks.moe",
    "profile": "benchmarks.profile_steps",
    "summary": "benchmarks.summary",
}

if __name__ == "__main__":
    argv = sys.argv[1:]
    named = [a for a in argv if a in STANDALONE]
    if named:
        rest = [a for a in argv if a != named[0]]
        raise SystemExit(importlib.import_module(STANDALONE[named[0]]).main(rest))
    raise SystemExit(main())
