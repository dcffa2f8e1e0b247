"""The exit codes of ``kolossos train``'s processes (no torch import: the command line reads
them)."""

from __future__ import annotations

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_NONFINITE", "NOT_RETRIED"]

EXIT_FAILED = 1
"""A rank failed (its report names the rank, the place and the exception)."""
EXIT_CONFIG = 2
"""A configuration or checkpoint-file error, found before training (printed by rank 0)."""
EXIT_NONFINITE = 3
"""The numerics guard stopped the run (every rank agreed at the same step)."""
EXIT_INTERRUPTED = 130
"""Stopped by SIGINT/SIGTERM after a clean, agreed stop."""
NOT_RETRIED = (EXIT_CONFIG, EXIT_NONFINITE, EXIT_INTERRUPTED)
"""Codes a restart would only repeat: ``--max_restarts`` does not relaunch after them."""
