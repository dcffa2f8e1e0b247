"""Launch's pure rules: environment parsing, backend choice, timeout, config and rank checks."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from kolossos.initialize import get_default_parser
from kolossos.launch_env import (
    DEFAULT_TIMEOUT_S,
    RankInfo,
    env_from_openmpi,
    env_from_slurm,
    env_from_torch,
    init_method_url,
    resolve_backend,
    resolve_timeout,
    validate_config,
    validate_rank_info,
)

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_torchrun_variables() -> None:
    info = env_from_torch(TORCHRUN)
    assert info == RankInfo(rank=3, world_size=8, local_rank=1, host="10.0.0.1", port=29500)


@pytest.mark.parametrize("missing", sorted(TORCHRUN))
def test_torchrun_missing_variable_is_named(missing: str) -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != missing}
    with pytest.raises(RuntimeError, match=missing) as err:
        env_from_torch(env)
    assert "torchrun" in str(err.value)


def test_torchrun_non_integer_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE='eight'"):
        env_from_torch({**TORCHRUN, "WORLD_SIZE": "eight"})


def test_slurm_variables() -> None:
    info = env_from_slurm({"SLURM_PROCID": "5", "SLURM_NPROCS": "16", "SLURM_LOCALID": "1"})
    assert (info.rank, info.world_size, info.local_rank) == (5, 16, 1)
    # SLURM_NTASKS is the newer name of the task count
    assert env_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).world_size == 4
    with pytest.raises(RuntimeError, match="SLURM_PROCID"):
        env_from_slurm({"SLURM_NPROCS": "4"})
    with pytest.raises(RuntimeError, match="SLURM_NPROCS"):
        env_from_slurm({"SLURM_PROCID": "0"})


def test_openmpi_variables() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    }
    info = env_from_openmpi(env)
    assert (info.rank, info.world_size, info.local_rank) == (6, 8, 2)
    del env["OMPI_COMM_WORLD_LOCAL_RANK"]
    with pytest.raises(RuntimeError, match="OMPI_COMM_WORLD_LOCAL_RANK"):
        env_from_openmpi(env)


@pytest.mark.parametrize(
    ("info", "match"),
    [
        (RankInfo(rank=0, world_size=0), "world_size=0"),
        (RankInfo(rank=4, world_size=4), "rank=4"),
        (RankInfo(rank=-1, world_size=4), "rank=-1"),
        (RankInfo(rank=0, world_size=2, local_rank=-1), "local_rank=-1"),
        (RankInfo(rank=0, world_size=2, port=70000), "port=70000"),
        (RankInfo(rank=0, world_size=2, port=0), "port=0"),
        (RankInfo(rank=0, world_size=2, host="  "), "host is empty"),
    ],
)
def test_bad_rank_info(info: RankInfo, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_rank_info(info)


def test_backend_choice() -> None:
    assert resolve_backend(None, cuda_available=True) == ("nccl", None)
    assert resolve_backend(None, cuda_available=False) == ("gloo", None)
    assert resolve_backend("gloo", cuda_available=True) == ("gloo", None)
    backend, warning = resolve_backend("nccl", cuda_available=False)
    assert backend == "gloo" and warning is not None and "nccl" in warning
    with pytest.raises(ValueError, match="'tcp'"):
        resolve_backend("tcp", cuda_available=False)


def test_timeout_sources() -> None:
    assert resolve_timeout(None, {}) == timedelta(seconds=DEFAULT_TIMEOUT_S)
    assert resolve_timeout(None, {"KOLOSSOS_DIST_TIMEOUT": "42"}) == timedelta(seconds=42)
    assert resolve_timeout(7, {"KOLOSSOS_DIST_TIMEOUT": "42"}) == timedelta(seconds=7)
    assert resolve_timeout(timedelta(minutes=1), {}) == timedelta(seconds=60)
    with pytest.raises(ValueError, match="KOLOSSOS_DIST_TIMEOUT='soon'"):
        resolve_timeout(None, {"KOLOSSOS_DIST_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="positive"):
        resolve_timeout(0, {})


def test_config_forms(tmp_path: Path) -> None:
    assert validate_config(None) == {}
    assert validate_config({"a": 1}) == {"a": 1}
    cfg = tmp_path / "config.py"
    cfg.write_text("BATCH_SIZE = 4\n")
    assert validate_config(str(cfg)) == cfg.resolve()
    assert validate_config(cfg) == cfg.resolve()
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        validate_config(tmp_path / "nope.py")
    with pytest.raises(TypeError, match="list"):
        validate_config([1, 2])  # type: ignore[arg-type]


def test_init_method_url() -> None:
    assert init_method_url("localhost", 29500) == "tcp://localhost:29500"
    assert init_method_url("::1", 29500) == "tcp://[::1]:29500"


def test_default_parser_arguments() -> None:
    args = get_default_parser().parse_args(
        [
            "--config",
            "c.py",
            "--host",
            "h",
            "--port",
            "1234",
            "--world_size",
            "4",
            "--rank",
            "2",
            "--local_rank",
            "0",
            "--backend",
            "gloo",
        ]
    )
    assert (args.config, args.host, args.port, args.world_size, args.rank) == (
        "c.py",
        "h",
        1234,
        4,
        2,
    )
    assert (args.local_rank, args.backend) == (0, "gloo")
    defaults = get_default_parser().parse_args([])
    assert defaults.backend is None and defaults.port == 29500
