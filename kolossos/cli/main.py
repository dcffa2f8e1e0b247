"""Entry point of the ``kolossos`` console script.

Each sub-command lives in its own module exposing ``main(argv: list[str]) -> int``; this module only
dispatches, so that ``kolossos run`` can hand everything after the script name to the user's script
untouched (argparse sub-parsers cannot do that cleanly).
"""

from __future__ import annotations

import importlib
import sys

from kolossos import __version__

#: sub-command name -> (module path, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("kolossos.cli.run", "launch a script on one or several nodes (torch elastic + ssh)"),
    "check": ("kolossos.cli.check", "report the installation: versions, backends, extras"),
    "train": (
        "kolossos.cli.train",
        "train a GPT from a config file (the built-in Shakespeare example without one)",
    ),
    "export": (
        "kolossos.cli.export",
        "write a kolossos train checkpoint as a Hugging Face model folder",
    ),
    "generate": (
        "kolossos.cli.generate",
        "sample text from a kolossos train run or a Hugging Face model folder",
    ),
    "serve": ("kolossos.cli.serve", "serve a model folder over an OpenAI-compatible HTTP API"),
    "plan": (
        "kolossos.cli.plan",
        "choose a plugin and layout that fits a model in a memory budget",
    ),
    "benchmark": (
        "kolossos.cli.benchmark",
        "time an MLP under every tensor-parallel layout N processes allow",
    ),
}

USAGE = """usage: kolossos [-h] [--version] <command> [<args>]

commands:
{commands}

Run 'kolossos <command> --help' for the options of one command."""


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name.ljust(width)}  {doc}" for name, (_, doc) in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Run the ``kolossos`` command line and return its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"kolossos {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"kolossos: unknown command {name!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    code: int = module.main(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
