"""``kolossos check -i``: report whether this installation can train, and what to fix if not.

Each probe is a module-level function returning plain data, so tests can replace one to simulate a
broken installation. Probes that could hang or crash (a real gloo round trip, importing optional
packages) run in subprocesses with a timeout. torch is imported lazily: a missing torch is a
finding, not a crash.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from kolossos._version import __version__

__all__ = ["MIN_TORCH", "Report", "build_report", "main"]

MIN_TORCH = (2, 9)  #: oldest torch release kolossos supports
_MARK = "KOLOSSOS_PROBE "  # prefixes the JSON line of a probe subprocess (libraries may print too)

#: package -> (import name, why kolossos wants it / how to install it)
REQUIRED = {
    "numpy": ("numpy", "pip install numpy"),
    "psutil": ("psutil", "pip install psutil"),
    "packaging": ("packaging", "pip install packaging"),
}
OPTIONAL = {
    "transformers": ("transformers", "Hugging Face models: pip install 'kolossos[hf]'"),
    "safetensors": ("safetensors", "HF checkpoints: pip install 'kolossos[hf]'"),
    "tokenizers": ("tokenizers", "HF tokenizers: pip install 'kolossos[hf]'"),
    "matplotlib": ("matplotlib", "benchmark plots: pip install matplotlib"),
    "deepspeed": ("deepspeed", "benchmark baseline: pip install deepspeed==0.19.8"),
    "tensorboard": ("tensorboard", "training logs: pip install 'kolossos[data]'"),
    "pyarrow": ("pyarrow", "Parquet training data: pip install 'kolossos[data]'"),
    "datasets": ("datasets", "load_from_disk training data: pip install 'kolossos[data]'"),
    "fastapi": ("fastapi", "kolossos serve: pip install 'kolossos[serve]'"),
    "uvicorn": ("uvicorn", "kolossos serve: pip install 'kolossos[serve]'"),
    "scipy": ("scipy", "auto-parallel ILP solver: pip install 'kolossos[auto]'"),
}

_GLOO_SCRIPT = r"""
import json, os, tempfile, time
from datetime import timedelta
start = time.perf_counter()
import torch
import torch.distributed as dist
with tempfile.TemporaryDirectory() as tmp:
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        x = torch.arange(8, dtype=torch.float32)
        dist.all_reduce(x)
        ok = bool(torch.equal(x, torch.arange(8, dtype=torch.float32)))
    finally:
        dist.destroy_process_group()
print("KOLOSSOS_PROBE " + json.dumps({"ok": ok, "seconds": time.perf_counter() - start}))
"""

_IMPORT_SCRIPT = r"""
import importlib, json, sys
result = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        result[name] = ""
    except BaseException as exc:
        result[name] = f"{type(exc).__name__}: {exc}"[:200]
print("KOLOSSOS_PROBE " + json.dumps(result))
"""


@dataclass
class Report:
    """What ``check -i`` found: table sections, blocking problems and warnings."""

    sections: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  #: "what is broken -- how to fix"
    warnings: list[str] = field(default_factory=list)
    missing_extras: list[str] = field(default_factory=list)  #: optional packages not installed
    ready: str = ""  #: what works, for the verdict after "kolossos is ready: "

    def add(self, section: str, label: str, value: str, note: str = "") -> None:
        """Append a row to ``section``."""
        self.sections.setdefault(section, []).append((label, value, note))

    @property
    def ok(self) -> bool:
        """Whether kolossos can be used (no blocking problem)."""
        return not self.problems

    def verdict(self) -> str:
        """Return the one-line conclusion."""
        if self.problems:
            return "kolossos is NOT ready: " + "; ".join(self.problems)
        extra = f"; warnings: {'; '.join(self.warnings)}" if self.warnings else ""
        if self.missing_extras:
            extra += f"; optional packages not installed: {', '.join(self.missing_extras)}"
        return f"kolossos is ready: {self.ready}{extra}"

    def render(self) -> str:
        """Return the report as an aligned plain-text table ending with the verdict."""
        lines = ["kolossos check --installation", ""]
        for title, rows in self.sections.items():
            lines.append(title)
            for label, value, note in rows:
                lines.append(f"  {label:<14} {value:<22} {note}".rstrip())
            lines.append("")
        lines.append(self.verdict())
        return "\n".join(lines)


# ---------------------------------------------------------------------- probes
def _run_probe(args: list[str], timeout: float) -> tuple[Any, str]:
    """Run ``python args...``; return (decoded JSON payload or None, error text)."""
    try:
        proc = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:g} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :]), ""
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return None, tail[:200]


def probe_torch() -> dict[str, Any]:
    """Return torch's version and build (CUDA, NCCL, cuDNN), or ``{"error": ...}``."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken build raising OSError etc.
        return {"error": f"{type(exc).__name__}: {exc}"}
    info: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    info["cuda_available"] = bool(torch.cuda.is_available())
    try:
        nccl = torch.cuda.nccl.version() if info["cuda_available"] else None
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    except Exception:
        info["nccl"] = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if isinstance(cudnn, int):  # 90100 -> 9.1.0 (cuDNN 9), 8902 -> 8.9.2 (cuDNN 8)
        major, rest = divmod(cudnn, 10000 if cudnn >= 90000 else 1000)
        cudnn = f"{major}.{rest // 100}.{rest % 100}"
    info["cudnn"] = cudnn
    return info


def probe_backends() -> dict[str, bool]:
    """Return which ``torch.distributed`` backends this torch build includes."""
    import torch.distributed as dist

    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    return {
        "gloo": bool(dist.is_gloo_available()),
        "nccl": bool(dist.is_nccl_available()),
        "mpi": bool(dist.is_mpi_available()),
    }


def probe_gloo(timeout: float) -> tuple[bool, str]:
    """Initialise a one-process gloo group and all_reduce in a subprocess: (works, detail)."""
    payload, error = _run_probe(["-c", _GLOO_SCRIPT], timeout)
    if payload is None:
        return False, error
    if not payload["ok"]:
        return False, "all_reduce returned a wrong result"
    return True, f"init + all_reduce in 1 process ({payload['seconds']:.1f} s)"


def probe_accelerator() -> dict[str, Any]:
    """Return the chosen accelerator's name, backend, devices and memory, or ``{"error": ...}``."""
    try:
        from kolossos.accelerator import get_accelerator

        acc = get_accelerator()
        return {
            "name": acc.name,
            "backend": acc.communication_backend,
            "count": acc.device_count(),
            "device": acc.get_device_name(),
            "memory": acc.total_memory(),
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def probe_packages(names: list[str], timeout: float) -> dict[str, tuple[str | None, str]]:
    """Return package -> (installed version or None, import error or "") via one subprocess."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    installed = [name for name in names if versions[name] is not None]
    imports = [REQUIRED.get(name, OPTIONAL.get(name, (name, "")))[0] for name in installed]
    payload, error = _run_probe(["-c", _IMPORT_SCRIPT, *imports], timeout) if imports else ({}, "")
    result: dict[str, tuple[str | None, str]] = {}
    for name, module in zip(installed, imports, strict=True):
        result[name] = (versions[name], error if payload is None else payload.get(module, ""))
    for name in names:
        result.setdefault(name, (None, ""))
    return result


# ---------------------------------------------------------------------- the report
def _version_tuple(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``"2.10.0a0"`` -> ``(2, 10)``."""
    major, minor = [*version.split("+")[0].split("."), "0", "0"][:2]
    digits = ["".join(c for c in part if c.isdigit()) or "0" for part in (major, minor)]
    return int(digits[0]), int(digits[1])


def _torch_section(report: Report, torch_info: dict[str, Any]) -> bool:
    """Fill the versions section; return whether torch is usable."""
    report.add("Versions", "kolossos", __version__)
    report.add("Versions", "Python", platform.python_version(), sys.executable)
    if "error" in torch_info:
        report.add("Versions", "torch", "MISSING", torch_info["error"])
        report.problems.append("torch cannot be imported -- fix: pip install 'torch>=2.9'")
        return False
    version = torch_info["version"]
    if _version_tuple(version) < MIN_TORCH:
        report.add("Versions", "torch", version, "TOO OLD (kolossos needs >= 2.9)")
        report.problems.append(f"torch {version} is too old -- fix: pip install -U 'torch>=2.9'")
        return False
    report.add("Versions", "torch", version, "ok (>= 2.9)")
    cuda_note = "GPU visible" if torch_info["cuda_available"] else "no GPU visible"
    if torch_info["cuda"] is None:
        cuda_note = "CPU-only torch build"
    report.add("Versions", "CUDA runtime", torch_info["cuda"] or "-", cuda_note)
    report.add("Versions", "NCCL", torch_info["nccl"] or "-")
    report.add("Versions", "cuDNN", str(torch_info["cudnn"] or "-"))
    return True


def _backend_section(
    report: Report, available: dict[str, bool], gloo: tuple[bool, str]
) -> list[str]:
    """Fill the backends section; return the usable backends (none is a problem)."""
    usable: list[str] = []
    for name in ("gloo", "nccl", "mpi"):
        if not available.get(name):
            report.add("Distributed backends", name, "not available")
            continue
        if name == "gloo":
            works, detail = gloo
            report.add(
                "Distributed backends",
                name,
                "available",
                ("works: " if works else "BROKEN: ") + detail,
            )
            if not works:
                report.warnings.append(f"gloo is built in but failed a round trip ({detail})")
                continue
        else:
            report.add("Distributed backends", name, "available")
        usable.append(name)
    if not usable:
        report.problems.append(
            "no usable torch.distributed backend -- fix: reinstall torch from pytorch.org (its "
            "wheels include gloo); if gloo is built in but broken, set GLOO_SOCKET_IFNAME to a "
            "working network interface (e.g. lo)"
        )
    return usable


def _accelerator_section(report: Report, acc: dict[str, Any]) -> str:
    """Fill the accelerator section; return a short description for the verdict."""
    if "error" in acc:
        report.add("Accelerator", "name", "ERROR", acc["error"])
        report.problems.append(
            f"no accelerator ({acc['error']}) -- fix: unset or correct "
            "KOLOSSOS_ACCELERATOR, or install a CUDA build of torch"
        )
        return "no accelerator"
    kind = "physical RAM" if acc["name"] == "cpu" else "per device"
    report.add("Accelerator", "name", acc["name"], f"communication backend {acc['backend']}")
    report.add("Accelerator", "devices", str(acc["count"]), acc["device"])
    report.add("Accelerator", "memory", f"{acc['memory'] / 2**30:.1f} GiB", kind)
    plural = "s" if acc["count"] != 1 else ""
    return f"accelerator {acc['name']} ({acc['count']} device{plural})"


def _package_section(report: Report, packages: dict[str, tuple[str | None, str]]) -> None:
    """Fill the package sections; a missing required package is a problem, an optional one not."""
    for table, title, required in (
        (REQUIRED, "Required packages", True),
        (OPTIONAL, "Optional packages", False),
    ):
        for name, (_, hint) in table.items():
            version, error = packages.get(name, (None, ""))
            if version is None:
                report.add(title, name, "-", f"not installed ({hint})")
            elif error:
                report.add(title, name, version, f"FAILS TO IMPORT: {error}")
            else:
                report.add(title, name, version, "imports")
            if required and (version is None or error):
                what = "is not installed" if version is None else "fails to import"
                report.problems.append(f"required package {name} {what} -- fix: {hint}")
            elif version is None:
                report.missing_extras.append(name)
            elif error:
                report.warnings.append(f"optional package {name} fails to import")


def build_report(timeout: float = 120.0) -> Report:
    """Run every probe and assemble the report (probes in subprocesses run concurrently)."""
    report = Report()
    names = list(REQUIRED) + list(OPTIONAL)
    with ThreadPoolExecutor(max_workers=2) as pool:
        packages_job = pool.submit(probe_packages, names, timeout)
        torch_info = probe_torch()
        if _torch_section(report, torch_info):
            backends = probe_backends()
            gloo_job = pool.submit(probe_gloo, timeout) if backends.get("gloo") else None
            gloo = gloo_job.result() if gloo_job is not None else (False, "not built in")
            usable = _backend_section(report, backends, gloo)
            accelerator = _accelerator_section(report, probe_accelerator())
            report.ready = (
                f"torch {torch_info['version']}, {accelerator}, backends {', '.join(usable)}"
            )
        _package_section(report, packages_job.result())
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kolossos check", description="Check that kolossos and its dependencies work."
    )
    parser.add_argument(
        "-i",
        "--installation",
        action="store_true",
        help="report versions, distributed backends, accelerator and extras",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="time limit of each probe subprocess (default: 120)",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run ``kolossos check``; return 0 when usable, 1 when broken, 2 on a usage error."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # -h (0) or a bad option (2)
        return int(exc.code or 0)
    if not args.installation:
        parser.print_help()
        return 2
    if args.timeout <= 0:
        print(f"kolossos check: --timeout={args.timeout} must be positive.", file=sys.stderr)
        return 2
    report = build_report(args.timeout)
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
