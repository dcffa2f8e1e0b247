"""``kolossos check -i`` decides "ready" or "broken" from its probes (probes simulated here)."""

from __future__ import annotations

from typing import Any

import pytest

from kolossos.cli import check

GOOD_TORCH = {"version": "2.13.0+cpu", "cuda": None, "cuda_available": False, "nccl": None,
              "cudnn": None}  # fmt: skip


@pytest.fixture
def healthy(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Patch every probe to describe a working CPU installation (no subprocess is started)."""
    packages = {name: ("1.0", "") for name in [*check.REQUIRED, *check.OPTIONAL]}
    accelerator = {"name": "cpu", "backend": "gloo", "count": 1, "device": "x", "memory": 2**34}
    monkeypatch.setattr(check, "probe_torch", lambda: dict(GOOD_TORCH))
    monkeypatch.setattr(
        check, "probe_backends", lambda: {"gloo": True, "nccl": False, "mpi": False}
    )
    monkeypatch.setattr(check, "probe_gloo", lambda timeout: (True, "fine"))
    monkeypatch.setattr(check, "probe_accelerator", lambda: accelerator)
    monkeypatch.setattr(check, "probe_packages", lambda names, timeout: dict(packages))
    return monkeypatch


def _run(capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = check.main(["-i"])
    return code, capsys.readouterr().out.strip().splitlines()[-1]


def test_healthy_installation_is_ready(healthy: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, verdict = _run(capsys)
    assert code == 0
    assert verdict.startswith("kolossos is ready: torch 2.13.0+cpu, accelerator cpu (1 device)")


@pytest.mark.parametrize(
    ("probe", "value", "named"),
    [
        ("probe_torch", {"error": "ModuleNotFoundError: No module named 'torch'"}, "torch"),
        ("probe_torch", {**GOOD_TORCH, "version": "2.5.1+cu121"}, "torch 2.5.1+cu121 is too old"),
        ("probe_backends", {"gloo": False, "nccl": False, "mpi": False}, "no usable"),
        ("probe_accelerator", {"error": "RuntimeError: cuda forced"}, "no accelerator"),
    ],
)
def test_broken_states_fail_and_name_the_problem(
    healthy: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    probe: str,
    value: dict[str, Any],
    named: str,
) -> None:
    healthy.setattr(check, probe, lambda: value)
    code, verdict = _run(capsys)
    assert code != 0
    assert verdict.startswith("kolossos is NOT ready:") and named in verdict
    assert "fix:" in verdict


def test_gloo_broken_without_other_backend_is_fatal(
    healthy: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    healthy.setattr(check, "probe_gloo", lambda timeout: (False, "timed out after 5 s"))
    code, verdict = _run(capsys)
    assert code == 1 and "no usable torch.distributed backend" in verdict


def test_gloo_broken_with_nccl_is_a_warning(
    healthy: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    healthy.setattr(check, "probe_backends", lambda: {"gloo": True, "nccl": True, "mpi": False})
    healthy.setattr(check, "probe_gloo", lambda timeout: (False, "connect failed"))
    code, verdict = _run(capsys)
    assert code == 0 and "backends nccl" in verdict and "gloo is built in but failed" in verdict


def test_missing_packages(healthy: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    packages: dict[str, tuple[str | None, str]]
    packages = {name: ("1.0", "") for name in [*check.REQUIRED, *check.OPTIONAL]}
    packages["deepspeed"] = (None, "")
    healthy.setattr(check, "probe_packages", lambda names, timeout: dict(packages))
    code, verdict = _run(capsys)
    assert code == 0 and "optional packages not installed: deepspeed" in verdict
    packages["psutil"] = ("7.0", "ImportError: boom")
    code, verdict = _run(capsys)
    assert code == 1 and "required package psutil fails to import" in verdict


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([]) == 2
    assert "--installation" in capsys.readouterr().out
    assert check.main(["--bogus"]) == 2
    assert check.main(["-i", "--timeout", "0"]) == 2


def test_version_tuple() -> None:
    assert check._version_tuple("2.13.0+cpu") == (2, 13)
    assert check._version_tuple("2.10.0a0+git123") == (2, 10)
    assert check._version_tuple("3") == (3, 0)
