"""The machinery behind ``kolossos run``: hostfiles, per-node commands and their supervision.

* :mod:`.hostfile` parses a hostfile and the ``--host`` list and selects nodes
  (``--include``/``--exclude``/``--num_nodes``).
* :mod:`.plan` turns the command-line values into a validated :class:`~.plan.LaunchPlan`.
* :mod:`.command` builds the argv of each node (torchrun, the remote shell command, ssh).
* :mod:`.guard` is a stdlib-only wrapper run on every node; it kills the node's whole process tree
  when its stdin closes (the launcher or the ssh connection went away) or on a signal.
* :mod:`.multinode` starts the per-node processes and stops all of them when one fails.
"""

from __future__ import annotations

from kolossos.cli.launcher.errors import LaunchConfigError

__all__ = ["LaunchConfigError"]
