"""Build the argv of each node: torchrun, the guard around it, and the ssh command for remote nodes.

Quoting rule: local commands are argv lists (no shell). The one string that a shell interprets,
the command ssh hands to the remote login shell, is built only from :func:`shlex.quote`-d pieces,
so no argument, environment value or path can inject shell syntax. Host names never enter that
string; they are validated (:func:`~kolossos.cli.launcher.hostfile.validate_hostname`) and passed
to ssh after ``--``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from kolossos.cli.launcher.errors import LaunchConfigError

#: Environment variables exported to remote nodes by exact name.
FORWARDED_ENV_NAMES: tuple[str, ...] = (
    "PATH",
    "LD_LIBRARY_PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
)
#: ... and by prefix (thread counts, communication back-ends, torch, Hugging Face caches).
FORWARDED_ENV_PREFIXES: tuple[str, ...] = (
    "KOLOSSOS_",
    "PYTHON",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "CUDA_",
    "UCX_",
    "FI_",
    "HF_",
    "TRANSFORMERS_",
)
#: Names holding one of these words are never exported implicitly: exported values appear in the
#: remote process list and in ``--dry-run`` output. List such a name in ``KOLOSSOS_RUN_EXPORT`` to
#: export it anyway.
SECRET_MARKERS: tuple[str, ...] = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY")
#: Comma-separated extra variable names to export.
EXPORT_LIST_VAR = "KOLOSSOS_RUN_EXPORT"
#: torchrun flags that ``kolossos run`` sets itself; ``--extra_launch_args`` may not repeat them.
MANAGED_TORCHRUN_FLAGS = frozenset(
    {"nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "max_restarts"}
    | {"standalone", "rdzv_endpoint"}
)

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FLAG_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
GUARD_SCRIPT = Path(__file__).with_name("guard.py")


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Select the variables of ``environ`` exported to remote nodes (sorted by name)."""
    extra = {name.strip() for name in environ.get(EXPORT_LIST_VAR, "").split(",") if name.strip()}
    chosen: dict[str, str] = {}
    for name in sorted(environ):
        if not _ENV_NAME_RE.fullmatch(name):
            continue
        listed = name in FORWARDED_ENV_NAMES or name.startswith(FORWARDED_ENV_PREFIXES)
        secret = any(marker in name.upper() for marker in SECRET_MARKERS)
        if name in extra or (listed and not secret):
            chosen[name] = environ[name]
    return chosen


def parse_extra_launch_args(value: str | None) -> list[str]:
    """Turn ``--extra_launch_args`` (``k=v,flag,k2=v2``) into torchrun flags.

    ``k=v`` becomes ``--k v``; a bare ``flag`` becomes ``--flag``. Values cannot contain commas.

    Raises:
        LaunchConfigError: for an empty item or key, a key that is not a flag name, or a flag that
            ``kolossos run`` sets itself.
    """
    if value is None:
        return []
    flags: list[str] = []
    for item in value.split(","):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not _FLAG_NAME_RE.fullmatch(key):
            raise LaunchConfigError(
                f"--extra_launch_args {value!r}: item {item!r} is not 'name=value' or 'name' "
                "with a torchrun flag name (letters, digits, '_' or '-', no leading dashes); "
                "write e.g. --extra_launch_args monitor_interval=1,log_dir=/tmp/logs"
            )
        if key.replace("-", "_") in MANAGED_TORCHRUN_FLAGS:
            raise LaunchConfigError(
                f"--extra_launch_args {value!r}: '{key}' is set by kolossos run itself; use "
                "kolossos run's own option (--nproc_per_node, --master_addr, --master_port, "
                "--host...)."
            )
        flags.append(f"--{key}")
        if sep:
            flags.append(val)
    return flags


def torchrun_argv(
    *,
    python: str,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    extra_flags: Sequence[str],
    script: str,
    script_args: Sequence[str],
) -> list[str]:
    """The torch elastic launcher command of one node (``python -m torch.distributed.run ...``)."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc_per_node),
        "--nnodes",
        str(nnodes),
        "--node_rank",
        str(node_rank),
        "--master_addr",
        master_addr,
        "--master_port",
        str(master_port),
        "--max_restarts",
        "0",
        *extra_flags,
        script,
        *script_args,
    ]


def guard_argv(*, python: str, grace: float, command: Sequence[str]) -> list[str]:
    """Wrap ``command`` in the process-tree guard (see :mod:`kolossos.cli.launcher.guard`).

    ``-I`` (isolated mode) keeps the guard's own folder and user site-packages off its
    ``sys.path``; ``command`` still gets the full environment.
    """
    return [python, "-I", str(GUARD_SCRIPT), "--grace", f"{grace:g}", "--", *command]


def remote_shell_command(*, cwd: str, env: Mapping[str, str], argv: Sequence[str]) -> str:
    """The command string run by the remote login shell: ``cd DIR && exec env K=V ... ARGV``.

    Every piece is :func:`shlex.quote`-d; ``shlex.split`` of the result gives back ``cd``, ``DIR``,
    ``&&``, ``exec``, ``env``, the ``K=V`` pairs and ``argv`` unchanged.
    """
    assignments = [f"{name}={value}" for name, value in env.items()]
    parts = ["exec", "env", *assignments, *argv]
    return f"cd {shlex.quote(cwd)} && " + " ".join(shlex.quote(part) for part in parts)


def ssh_argv(
    *,
    host: str,
    command: str,
    ssh_port: int | None = None,
    ssh_config: str | None = None,
    ssh_options: Sequence[str] = (),
) -> list[str]:
    """The ssh client argv that runs ``command`` on ``host``.

    ``BatchMode=yes`` makes a missing key fail at once instead of prompting; ``-T`` keeps a pty
    away so the remote guard sees our stdin pipe close. ``~/.ssh/config`` (or ``ssh_config``)
    supplies users, keys and proxies; ``ssh_options`` are passed as ``-o`` options.
    """
    argv = ["ssh", "-T", "-o", "BatchMode=yes"]
    if ssh_config is not None:
        argv += ["-F", ssh_config]
    for option in ssh_options:
        argv += ["-o", option]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    return [*argv, "--", host, command]
