"""``kolossos run``: start a script on one or several nodes with the torch elastic launcher.

One node: ``python -m torch.distributed.run`` runs here. Several nodes: one torchrun per node over
OpenSSH, with ``--nnodes``/``--node_rank``/``--master_addr``/``--master_port`` set per node. If any
node fails, or ``kolossos run`` gets SIGINT/SIGTERM, every process on every node is stopped.
See ``docs/launch.md`` for the options, the hostfile format and the ssh setup.

Example::

    kolossos run --nproc_per_node 4 train.py --lr 0.1
    kolossos run --nproc_per_node 4 --hostfile ./hostfile --exclude node3 train.py
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import NoReturn

from kolossos.cli.launcher import multinode
from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.limits import check_port_free
from kolossos.cli.launcher.plan import LaunchPlan, build_plan
from kolossos.cli.launcher.restarts import run_with_restarts
from kolossos.cli.usage import explain_unknown
from kolossos.launch_env import WATCHDOG_ENV

PROG = "kolossos run"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so ``main`` owns the exit code."""

    def error(self, message: str) -> NoReturn:
        if "arguments are required: script" in message:
            message = "no script given; usage: kolossos run [options] script.py [script args]"
        if "expected one argument" in message:
            message += " (to pass a value that starts with '-', write --option=VALUE)"
        raise LaunchConfigError(explain_unknown(message, self))


def build_parser() -> argparse.ArgumentParser:
    """The ``kolossos run`` argument parser (options before the script; the rest goes to it)."""
    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Launch a script with torch elastic on one node, or on several over ssh. "
        "Options come before the script; everything after the script is passed to it.",
        epilog="Example: kolossos run --nproc_per_node 4 --hostfile hosts --master_addr node1 "
        "train.py --epochs 2",
    )
    p.add_argument(
        "--nproc_per_node", "--nproc-per-node", type=int, default=None, metavar="N",
        help="processes per node (default: the hostfile's slots, else 1)",
    )  # fmt: skip
    p.add_argument(
        "--host", "-H", "-host", default=None, metavar="H1,H2",
        help="comma-separated nodes to run on, in node-rank order",
    )  # fmt: skip
    p.add_argument(
        "--hostfile", default=None, metavar="FILE",
        help="file listing one node per line ('host' or 'host slots=N'; '#' comments)",
    )  # fmt: skip
    p.add_argument("--include", default=None, metavar="H1,H2", help="only these hostfile hosts")
    p.add_argument("--exclude", default=None, metavar="H1,H2", help="skip these hostfile hosts")
    p.add_argument(
        "--num_nodes", "--num-nodes", type=int, default=-1, metavar="K",
        help="use the first K hosts of the hostfile (default -1: all)",
    )  # fmt: skip
    p.add_argument(
        "--master_addr", "--master-addr", default=None, metavar="ADDR",
        help="rendezvous address (default: 127.0.0.1 on one node, else the first host)",
    )  # fmt: skip
    p.add_argument(
        "--master_port", "--master-port", type=int, default=29500, metavar="PORT",
        help="rendezvous port (default 29500)",
    )  # fmt: skip
    p.add_argument("--ssh-port", "--ssh_port", type=int, default=None, metavar="PORT",
                   help="ssh port of the nodes (default: ~/.ssh/config, else 22)")  # fmt: skip
    p.add_argument("--ssh-config", "--ssh_config", default=None, metavar="FILE",
                   help="ssh client config file (ssh -F); default ~/.ssh/config")  # fmt: skip
    p.add_argument(
        "--ssh-option", "--ssh_option", action="append", default=[], metavar="KEY=VALUE",
        help="extra ssh -o option; repeatable (e.g. ConnectTimeout=10)",
    )  # fmt: skip
    p.add_argument(
        "--extra_launch_args", "--extra-launch-args", default=None, metavar="K=V,...",
        help="more torchrun flags: 'k=v' becomes '--k v', a bare 'k' becomes '--k'",
    )  # fmt: skip
    p.add_argument(
        "--max_restarts", "--max-restarts", type=int, default=0, metavar="K",
        help="relaunch the whole job up to K times after a failure, without the nodes that no "
        "longer answer over ssh (the script resumes from its checkpoint; default 0)",
    )  # fmt: skip
    p.add_argument(
        "--watchdog", default=None, metavar="SECONDS",
        help="end the job when a rank makes no progress for SECONDS while its peers finished or "
        "wait for it, printing its stack (sets KOLOSSOS_WATCHDOG; default: off)",
    )  # fmt: skip
    p.add_argument("--dry-run", "--dry_run", action="store_true",
                   help="print the command of every node and exit")  # fmt: skip
    p.add_argument("script", help="the Python script to run (it calls launch_from_torch)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_plan(argv: list[str]) -> tuple[LaunchPlan, bool]:
    """Parse and validate ``argv``; return the plan and whether ``--dry-run`` was given.

    Raises:
        LaunchConfigError: for any bad option or value (nothing has been started).
    """
    args = build_parser().parse_args(argv)
    plan = build_plan(
        script=args.script,
        script_args=args.script_args,
        nproc_per_node=args.nproc_per_node,
        host=args.host,
        hostfile=args.hostfile,
        include=args.include,
        exclude=args.exclude,
        num_nodes=args.num_nodes,
        master_addr=args.master_addr,
        master_port=args.master_port,
        ssh_port=args.ssh_port,
        ssh_config=args.ssh_config,
        ssh_options=args.ssh_option,
        extra_launch_args=args.extra_launch_args,
        max_restarts=args.max_restarts,
        watchdog=args.watchdog,
    )
    return plan, bool(args.dry_run)


def format_dry_run(plan: LaunchPlan) -> str:
    """The ``--dry-run`` text: one ``# node R: HOST`` line and one shell-quoted command per node."""
    nodes = plan.node_commands()
    lines = []
    for node in nodes:
        how = "over ssh" if node.remote else "local"
        lines.append(f"# node {node.node_rank} of {len(nodes)}: {node.host} ({how})")
        lines.append(shlex.join(node.argv))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run ``kolossos run`` with ``argv`` (the words after ``run``); return the exit code.

    Returns 0 on success, 2 for a usage error (printed; nothing started), the failing node's code
    when a node fails, and 128 + N when signal N stopped the job.
    """
    try:
        plan, dry_run = parse_plan(argv)
        if dry_run:
            print(format_dry_run(plan))
            return 0
        nodes = plan.node_commands()
        multinode.check_ssh_available(nodes)
        if plan.is_local:  # node 0's rendezvous store listens here
            check_port_free(plan.master_port, "--master_port")
    except LaunchConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    if plan.watchdog_s is not None:  # every process of the job reads it (forwarded over ssh)
        os.environ[WATCHDOG_ENV] = f"{plan.watchdog_s:g}"
    return run_with_restarts(plan, plan.max_restarts)
