"""The error raised for a bad ``kolossos run`` invocation."""

from __future__ import annotations


class LaunchConfigError(ValueError):
    """A user error in the ``kolossos run`` arguments or hostfile.

    The message names the bad value, the rule it breaks and how to fix it. ``kolossos run`` prints
    it and exits with code 2 before starting any process.
    """
