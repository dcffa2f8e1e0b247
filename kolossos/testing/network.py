"""Free TCP ports for tests that need a real port (e.g. a launcher end-to-end test)."""

from __future__ import annotations

import random
import socket


def free_port(low: int = 20000, high: int = 60000, attempts: int = 100) -> int:
    """A TCP port in ``[low, high)`` that nothing listens on right now.

    Another process may still take it before you bind it: prefer :func:`kolossos.testing.spawn`,
    which needs no free port, and wrap tests that do with ``rerun_if_address_is_in_use``.

    Raises:
        RuntimeError: no free port was found in ``attempts`` tries.
    """
    for _ in range(attempts):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found in [{low}, {high}) after {attempts} attempts.")
