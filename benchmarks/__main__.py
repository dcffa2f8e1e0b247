"""Entry point of ``python -m benchmarks``."""

from __future__ import annotations

from benchmarks.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
