"""Side-by-side benchmarks of kolossos and its baselines (``python -m benchmarks --help``).

Not part of the installed package: run from the repository root. See ``docs/benchmarks.md``.
"""

from __future__ import annotations
