"""Bad inputs of ``kolossos train`` and ``kolossos run``, each refused before any process starts:
exit code 2 and one paragraph naming the value, the rule and the fix.

Table-driven and in-process: starting a process (the launcher, ``subprocess.Popen``) fails the
test, and nothing may be written where the run would go. Inputs that used to fail only inside
the launched workers (10-14 s later, as a traceback) are among them.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from test_train_config import _FakePlugin

from kolossos.booster.plugin import PLUGINS
from kolossos.booster.plugin.plugin_base import config_from_arguments
from kolossos.cli import run as run_cli
from kolossos.cli import train as train_cli
from kolossos.cli.launcher import limits, multinode
from kolossos.cli.launcher.errors import LaunchConfigError
from kolossos.cli.launcher.hostfile import host_key, parse_hostfile_text
from kolossos.cli.train_job import JobOutcome
from kolossos.ddp import TorchDDPConfig
from kolossos.fsdp import build_config
from kolossos.hybrid import HybridParallelConfig
from kolossos.testing.network import free_port
from kolossos.train import ConfigError, load_config
from kolossos.train.paths import STATE_FILE, RunPaths, checkpoint_name
from kolossos.train.plugins import build_plugin, check_plugin_values
from kolossos.train.prelaunch import check_data, resolve_resume
from kolossos.train.schema import config_to_dict
from kolossos.zero.gemini.gemini_config import GeminiConfig
from kolossos.zero.low_level.config import LowLevelZeroConfig

RUNS = "runs"  # output_dir of every kolossos train case: it must still be absent afterwards


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cwd holding the files the cases point at; starting a process fails the test."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    (tmp_path / "small.txt").write_text("abc defg\n" * 40)  # 360 characters, 8 distinct
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "shakespeare-char").write_text("a file where the run folder goes")
    (tmp_path / "half" / "shakespeare-char").mkdir(parents=True)
    (tmp_path / "half" / "shakespeare-char" / "checkpoints").write_text("not a folder")
    (tmp_path / "nan.toml").write_text("[train]\nlr = nan\n")
    (tmp_path / "inf.toml").write_text("[train]\nlr = inf\n")
    (tmp_path / "hosts_case").write_text("node1\nNODE1.\n")
    (tmp_path / "hosts_v6").write_text("::1\n0:0::1\n")
    (tmp_path / "hosts_many").write_text("localhost slots=100000\n")

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a process was started: {args!r}")

    monkeypatch.setattr(train_cli, "run_job", forbidden)
    monkeypatch.setattr(multinode, "run_nodes", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    return tmp_path


def refused(main: Callable[[list[str]], int], prog: str, argv: list[str], capsys: Any) -> str:
    """Run ``main(argv)``; check exit code 2 and a one-line ``PROG: error: ...``; return it."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err + captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


def assert_names(text: str, needles: list[str]) -> None:
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"


HYBRID = ["plugin=hybrid_parallel", "plugin_kwargs.tp_size=1"]
PIPE = [*HYBRID, "plugin_kwargs.pp_size=2", "plugin_kwargs.num_microbatches=2"]


# --------------------------------------------------------------------------- kolossos train
TRAIN_CASES = [
    # the rendezvous port
    pytest.param(["--master_port", "70000"], ["--master_port 70000", "1..65535"], id="port-70000"),
    pytest.param(["--master_port", "0"], ["--master_port 0", "1..65535", "free port"], id="port-0"),
    pytest.param(["--master_port=-5"], ["--master_port -5", "1..65535"], id="port-negative"),
    # the run folder
    pytest.param(["output_dir=a_file/sub"], ["output_dir = 'a_file/sub'", "a_file is a file"],
                 id="output-under-a-file"),
    pytest.param(["output_dir=a_file"], ["output_dir = 'a_file'", "is a file, not a folder"],
                 id="output-is-a-file"),
    pytest.param(["output_dir=taken"], ["taken/shakespeare-char is a file", "name="],
                 id="run-folder-is-a-file"),
    pytest.param(["output_dir=half"], ["checkpoints is a file", "Move the file away"],
                 id="checkpoints-is-a-file"),
    pytest.param(["output_dir=/proc/kolossos-test"], ["output_dir = '/proc/kolossos-test'",
                 "failed", "folder you can write to"], id="output-unwritable"),
    # the corpus
    pytest.param(["data.path=missing.txt"], ["data.path = 'missing.txt'", "does not exist",
                 "data.path=None"], id="corpus-missing"),
    pytest.param(["data.path=a_folder"], ["data.path = 'a_folder' is a folder"], id="corpus-dir"),
    pytest.param(["data.path=empty.txt"], ["data.path = 'empty.txt' is an empty file"],
                 id="corpus-empty"),
    pytest.param(["data.path=latin1.txt"], ["data.path = 'latin1.txt'", "UTF-8", "utf-8"],
                 id="corpus-not-utf8"),
    pytest.param(["model.block_size=100000000"], ["model.block_size = 100000000",
                 "at most 131632 tokens", "1316312 characters"], id="block-longer-than-corpus"),
    pytest.param(["data.path=small.txt", "model.block_size=40", "sample.tokens=0"],
                 ["model.block_size = 40",
                 "at most 36 tokens", "360 characters"], id="block-longer-than-val-split"),
    # the sample prompt (character tokenizer)
    pytest.param(["sample.prompt=\u20ac"], ["sample.prompt = '\u20ac'", "cannot encode",
                 "sample.tokens=0"], id="prompt-euro-sign"),
    pytest.param(["data.path=small.txt", "sample.prompt=xyz", "model.block_size=8"],
                 ["sample.prompt = 'xyz'", "small.txt cannot encode 'xyz'"],
                 id="prompt-not-in-custom-corpus"),
    # plugin keyword values, checked by the plugin's own config
    pytest.param(["plugin_kwargs.bucket_cap_mb=abc"], ["plugin_kwargs.bucket_cap_mb = 'abc'",
                 "TorchDDPPlugin", "must be a number of MiB"], id="ddp-bucket-not-a-number"),
    pytest.param(["plugin_kwargs.bucket_cap_mb=-1"], ["plugin_kwargs.bucket_cap_mb = -1",
                 "positive, finite"], id="ddp-bucket-negative"),
    pytest.param(["plugin_kwargs.bucket_cap_mb=1e999"], ["plugin_kwargs.bucket_cap_mb = inf",
                 "positive, finite"], id="ddp-bucket-inf"),
    pytest.param(["plugin_kwargs.find_unused_parameters=yes"],
                 ["plugin_kwargs.find_unused_parameters = 'yes'", "True or False"],
                 id="ddp-flag-not-bool"),
    pytest.param([*HYBRID, "plugin_kwargs.zero_stage=5"], ["plugin_kwargs.zero_stage = 5",
                 "HybridParallelPlugin", "must be 0 (DDP), 1 or 2"], id="hybrid-zero-stage-5"),
    pytest.param([*HYBRID, "plugin_kwargs.pp_style=foo"], ["plugin_kwargs.pp_style = 'foo'",
                 "not a pipeline schedule"], id="hybrid-pp-style"),
    pytest.param([*HYBRID, "plugin_kwargs.pp_size=2"], ["plugin_kwargs.pp_size = 2",
                 "num_microbatches"], id="hybrid-pipeline-without-microbatches"),
    pytest.param([*HYBRID, "plugin_kwargs.sp_size=abc"], ["plugin_kwargs.sp_size = 'abc'",
                 "int >= 1"], id="hybrid-sp-size-not-int"),
    pytest.param([*HYBRID, "plugin_kwargs.ddp_bucket_cap_mb=1e999"],
                 ["plugin_kwargs.ddp_bucket_cap_mb = inf", "finite"], id="hybrid-bucket-inf"),
    pytest.param([*HYBRID, "plugin_kwargs.custom_policy=gpt2"],
                 ["plugin_kwargs.custom_policy = 'gpt2'", "policy object"],
                 id="hybrid-policy-string"),
    pytest.param(["plugin=gemini", "plugin_kwargs.placement_policy=gpu"],
                 ["plugin_kwargs.placement_policy = 'gpu'", "GeminiPlugin", "'static' or 'auto'"],
                 id="gemini-placement-gpu"),
    pytest.param(["plugin=gemini", "plugin_kwargs.shard_param_frac=2"],
                 ["plugin_kwargs.shard_param_frac = 2", "[0, 1]"], id="gemini-fraction-2"),
    pytest.param(["plugin=gemini", "plugin_kwargs.search_range_m=abc"],
                 ["plugin_kwargs.search_range_m = 'abc'", "must be a number"],
                 id="gemini-search-not-a-number"),
    pytest.param(["plugin=low_level_zero", "plugin_kwargs.stage=3"],
                 ["plugin_kwargs.stage = 3", "GeminiPlugin or TorchFSDPPlugin"], id="zero-stage-3"),
    pytest.param(["plugin=low_level_zero", "plugin_kwargs.reduce_bucket_size_in_m=abc"],
                 ["plugin_kwargs.reduce_bucket_size_in_m = 'abc'", "millions"],
                 id="zero-bucket-not-a-number"),
    pytest.param(["plugin=low_level_zero", "plugin_kwargs.initial_scale=abc"],
                 ["plugin_kwargs.initial_scale = 'abc'", "must be a number"],
                 id="zero-loss-scale-not-a-number"),
    pytest.param(["plugin=torch_fsdp", "plugin_kwargs.sharding_strategy=FOO"],
                 ["plugin_kwargs.sharding_strategy = 'FOO'", "FULL_SHARD"], id="fsdp-sharding"),
    pytest.param(["plugin=torch_fsdp", "plugin_kwargs.use_orig_params=False"],
                 ["plugin_kwargs.use_orig_params = False", "no FSDP2 equivalent"],
                 id="fsdp-not-implemented"),
    pytest.param(["plugin=torch_fsdp", "plugin_kwargs.auto_wrap_policy=gpt2"],
                 ["plugin_kwargs.auto_wrap_policy = 'gpt2'", "set of Module classes"],
                 id="fsdp-wrap-policy-string"),
    pytest.param(["plugin=torch_fsdp", "plugin_kwargs.limit_all_gather=True"],
                 ["plugin_kwargs", "limit_all_gather", "unexpected keyword"],
                 id="fsdp-unknown-extra-keyword"),
    # the model-parallel layout against the model and the batch
    pytest.param(["plugin=hybrid_parallel", "plugin_kwargs.tp_size=3", "--nproc_per_node", "3",
                  "train.batch_size=63"],
                 ["plugin_kwargs.tp_size = 3", "divisors of model.n_head=4"],
                 id="tp-does-not-split-heads"),
    pytest.param([*PIPE, "model.n_layer=1"], ["plugin_kwargs.pp_size = 2", "model.n_layer = 1",
                  "model.n_layer >= 2"], id="more-stages-than-blocks"),
    pytest.param([*PIPE, "plugin_kwargs.num_layers_per_stage=[1,1]"],
                 ["plugin_kwargs.num_layers_per_stage = [1, 1]", "sum to model.n_layer=3"],
                 id="layers-per-stage-sum"),
    pytest.param([*PIPE, "train.gradient_accumulation=2"],
                 ["train.gradient_accumulation = 2", "1 with a pipeline"],
                 id="pipeline-with-accumulation"),
    pytest.param([*PIPE, "plugin_kwargs.num_microbatches=5"],
                 ["plugin_kwargs.num_microbatches = 5", "divisors of 32"],
                 id="microbatches-do-not-divide"),
    # values of the schema
    pytest.param(["nan.toml"], ["train.lr = nan", "finite numbers > 0"], id="lr-nan-in-toml"),
    pytest.param(["inf.toml"], ["train.lr = inf", "finite numbers > 0"], id="lr-inf-in-toml"),
    pytest.param(["train.lr=1e999"], ["train.lr = inf", "finite"], id="lr-inf-override"),
    pytest.param([f"seed={2**64}"], [f"seed = {2**64}", "torch's seed range"], id="seed-too-big"),
    pytest.param(["name=" + "n" * 300], ["at most 255"], id="name-too-long"),
    # --resume
    pytest.param(["--resume"], ["--resume: the run 'shakespeare-char' has no complete checkpoint",
                 "Drop --resume", "--resume=auto"], id="resume-without-checkpoint"),
    pytest.param(["--resume=yes"], ["--resume=yes is not allowed", "--resume=auto"],
                 id="resume-bad-value"),
    pytest.param(["--resume=auto", "--overwrite"], ["--resume=auto and --overwrite contradict"],
                 id="resume-auto-with-overwrite"),
    # the process count, and the options
    pytest.param(["--nproc_per_node", "100000"], ["--nproc_per_node 100000",
                 "per usable CPU core"], id="nproc-100000"),
    pytest.param(["nproc_per_node=100000"], ["nproc_per_node = 100000 (the config's)",
                 "per usable CPU core"], id="nproc-100000-in-config"),
    pytest.param(["--steps", "5"], ["unknown option --steps", "train.steps=..."],
                 id="flag-for-a-config-key"),
    pytest.param(["--nproc_per_nod", "2"], ["--nproc_per_nod (did you mean --nproc_per_node?)"],
                 id="misspelt-flag"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needles"), TRAIN_CASES)
def test_train_refuses_before_launch(
    argv: list[str], needles: list[str], workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(train_cli.main, "kolossos train", [f"output_dir={RUNS}", *argv], capsys)
    assert_names(line, needles)
    assert not (workdir / RUNS).exists()  # nothing written


def test_train_refuses_a_busy_port(
    busy_port: int, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [f"output_dir={RUNS}", "--master_port", str(busy_port)]
    line = refused(train_cli.main, "kolossos train", argv, capsys)
    assert_names(line, [f"--master_port {busy_port} cannot be used", "free port"])
    assert not (workdir / RUNS).exists()


class _FakeCuda:
    name = "cuda"

    def device_count(self) -> int:
        return 1


def test_train_refuses_more_processes_than_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kolossos.accelerator

    monkeypatch.setattr(kolossos.accelerator, "get_accelerator", _FakeCuda)
    # (the built-in default alone fits itself to one GPU: the count is asked for here)
    argv = [f"output_dir={RUNS}", "nproc_per_node=2"]
    line = refused(train_cli.main, "kolossos train", argv, capsys)
    assert_names(line, ["nproc_per_node = 2", "1 cuda device(s)", "KOLOSSOS_ACCELERATOR=cpu"])


def test_train_refuses_an_unknown_accelerator(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kolossos.accelerator import api

    monkeypatch.setenv(api.ACCELERATOR_ENV, "tpu")
    monkeypatch.setattr(api, "_accelerator", None)
    line = refused(train_cli.main, "kolossos train", [f"output_dir={RUNS}"], capsys)
    assert_names(line, ["'tpu'"])


@pytest.mark.parametrize(
    "argv", [["--nproc_per_node", "2"], ["--master_port", "29555"]], ids=["nproc", "port"]
)
def test_train_under_a_launcher_refuses_launch_options(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    line = refused(train_cli.main, "kolossos train", [f"output_dir={RUNS}", *argv], capsys)
    assert_names(line, [argv[0], "under a launcher", "Pass these options to the launcher"])


def _fake_checkpoint(workdir: Path, step: int, overrides: Sequence[str] = ()) -> RunPaths:
    config = load_config(None, [f"output_dir={workdir / RUNS}", *overrides])
    paths = RunPaths.of(config.output_dir, config.name)
    folder = paths.checkpoints / checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"step": step, "config": config_to_dict(config)}))
    return paths


def test_resumed_corpus_must_fit_the_saved_tokenizer(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ["data.path=small.txt", "model.block_size=8", "sample.prompt=abc"]
    paths = _fake_checkpoint(workdir, 5, overrides)
    paths.tokenizer.write_text(json.dumps({"kind": "char", "chars": "\n abcd"}))
    argv = [f"output_dir={RUNS}", *overrides, "--resume"]
    line = refused(train_cli.main, "kolossos train", argv, capsys)
    assert_names(line, ["data.path = 'small.txt'", "'efg'", "saved character tokenizer"])


# --------------------------------------------------------------------------- valid inputs start
@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    def run_job(paths: Any, nproc: int, *, port: Any, resume: bool, **_: Any) -> JobOutcome:
        calls.append((paths.config, nproc, port, resume))
        return JobOutcome(0, None, 0)

    monkeypatch.setattr(train_cli, "run_job", run_job)
    return calls


def test_a_valid_config_still_launches(launches: list[tuple[Any, ...]], workdir: Path) -> None:
    port = free_port()
    assert train_cli.main([f"output_dir={RUNS}", "--master_port", str(port)]) == 0
    [(config_json, nproc, given_port, resume)] = launches
    assert Path(config_json).is_file() and (nproc, given_port, resume) == (2, port, False)


@pytest.mark.parametrize("spelling", [["--resume=auto"], ["--resume", "auto"]])
def test_resume_auto(spelling: list[str], launches: list[tuple[Any, ...]], workdir: Path) -> None:
    assert train_cli.main([f"output_dir={RUNS}", *spelling]) == 0  # no checkpoint: fresh
    assert launches[-1][3] is False
    _fake_checkpoint(workdir, 10)
    assert train_cli.main([f"output_dir={RUNS}", *spelling]) == 0  # a checkpoint: continue
    assert launches[-1][3] is True
    assert train_cli.main([f"output_dir={RUNS}", "--resume"]) == 0
    assert launches[-1][3] is True


def test_resume_command_drops_every_resume_spelling() -> None:
    for argv in (
        ["a.toml", "--resume=auto"],
        ["a.toml", "--resume", "auto"],
        ["--resume", "a.toml"],
    ):
        assert train_cli.resume_command(argv) == "kolossos train a.toml --resume"


def test_resolve_resume_modes(workdir: Path) -> None:
    config = load_config(None, [f"output_dir={workdir / RUNS}"])
    assert resolve_resume(config, "no") is False and resolve_resume(config, "auto") is False
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve_resume(config, "must")
    _fake_checkpoint(workdir, 3)
    assert resolve_resume(config, "must") is True and resolve_resume(config, "auto") is True
    check_data(config, resume=True)  # no saved tokenizer: the corpus's characters


# --------------------------------------------------------------------------- kolossos run
RUN_CASES = [
    pytest.param(["--nproc_per_node", "100000", "train.py"],
                 ["--nproc_per_node 100000", "per usable CPU core"], id="nproc-100000"),
    pytest.param(["--host", "n1,n2", "--nproc_per_node", "5000", "train.py"],
                 ["--nproc_per_node 5000", f"more than {limits.REMOTE_MAX_NPROC}"],
                 id="nproc-remote-5000"),
    pytest.param(["--hostfile", "hosts_many", "train.py"], ["the hostfile's slots=100000"],
                 id="slots-100000"),
    pytest.param(["--master_port", "-1", "train.py"], ["--master_port -1", "1..65535"],
                 id="port-negative"),
    pytest.param(["a_folder"], ["script 'a_folder' is a folder"], id="script-is-a-folder"),
    pytest.param(["--hostfile", "hosts_case", "train.py"],
                 ["'NODE1.' is listed twice (as 'node1'", "ignore case"], id="hostfile-case-dup"),
    pytest.param(["--hostfile", "hosts_v6", "train.py"], ["'0:0::1' is listed twice"],
                 id="hostfile-ipv6-dup"),
    pytest.param(["--host", "node1,Node1", "train.py"], ["repeats Node1, node1", "ignore case"],
                 id="host-list-case-dup"),
    pytest.param(["--nproc_per_nod", "2", "train.py"],
                 ["--nproc_per_nod (did you mean --nproc_per_node?)", "kolossos run --help"],
                 id="misspelt-flag"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needles"), RUN_CASES)
def test_run_refuses_before_launch(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert_names(refused(run_cli.main, "kolossos run", argv, capsys), needles)


def test_run_refuses_a_busy_port(busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(
        run_cli.main, "kolossos run", ["--master_port", str(busy_port), "train.py"], capsys
    )
    assert_names(line, [f"--master_port {busy_port} cannot be used", "Pass a free port"])


def test_run_dry_run_does_not_probe_the_port(
    busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli.main(["--dry-run", "--master_port", str(busy_port), "train.py"]) == 0


def test_host_identity() -> None:
    assert host_key("Node1.") == host_key("node1") and host_key("0:0::1") == host_key("::1")
    assert host_key("fe80::1%eth0") != host_key("fe80::1")
    assert len(parse_hostfile_text("node1\nnode2\n")) == 2


def test_nproc_bound_is_eight_per_core() -> None:
    limit = limits.max_local_nproc()
    assert limit == limits.PROCS_PER_CPU * limits.usable_cpus() >= 8
    assert limits.check_nproc(limit, local=True, what="x") == limit
    with pytest.raises(LaunchConfigError, match=f"{limit} here"):
        limits.check_nproc(limit + 1, local=True, what="x")


# --------------------------------------------------------------------------- engine configs
CONFIG_CASES = [
    pytest.param(TorchDDPConfig, {"bucket_cap_mb": "abc"}, TypeError, "bucket_cap_mb='abc'",
                 id="ddp-bucket-str"),
    pytest.param(TorchDDPConfig, {"bucket_cap_mb": math.nan}, ValueError, "bucket_cap_mb=nan",
                 id="ddp-bucket-nan"),
    pytest.param(LowLevelZeroConfig, {"precision": ["fp16"]}, ValueError, "precision=['fp16']",
                 id="zero-precision-list"),
    pytest.param(LowLevelZeroConfig, {"reduce_bucket_size_in_m": math.inf}, ValueError,
                 "reduce_bucket_size_in_m=inf", id="zero-bucket-inf"),
    pytest.param(GeminiConfig, {"device": -1}, ValueError, "device=-1", id="gemini-device-neg"),
    pytest.param(GeminiConfig, {"precision": {"a": 1}}, ValueError, "precision={'a': 1}",
                 id="gemini-precision-dict"),
    pytest.param(HybridParallelConfig, {"tp_size": 1, "zero_bucket_size_in_m": math.inf},
                 ValueError, "zero_bucket_size_in_m=inf", id="hybrid-zero-bucket-inf"),
    pytest.param(HybridParallelConfig, {"tp_size": 1, "sp_size": "2"}, ValueError, "sp_size='2'",
                 id="hybrid-sp-size-str"),
    pytest.param(build_config, {"ignored_modules": 5}, TypeError, "ignored_modules=5",
                 id="fsdp-ignored-not-a-list"),
    pytest.param(build_config, {"auto_wrap_policy": [1]}, TypeError, "auto_wrap_policy holds [1]",
                 id="fsdp-wrap-policy-list-of-int"),
]  # fmt: skip


@pytest.mark.parametrize(("factory", "kwargs", "error", "needle"), CONFIG_CASES)
def test_engine_configs_name_the_argument(
    factory: Callable[..., Any], kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    with pytest.raises(error) as info:
        factory(**kwargs)
    assert needle in str(info.value)


# --------------------------------------------------------------------------- plugin contract
@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_check_arguments_needs_no_process_group(name: str) -> None:
    cls = PLUGINS[name]
    assert cls.config_factory is not None
    config = cls.check_arguments(**({"tp_size": 1} if name == "hybrid_parallel" else {}))
    assert config is not None and not dist.is_initialized()
    with pytest.raises(TypeError):
        cls.check_arguments(no_such_keyword=1)


class _RejectsBf16Config:
    def __init__(self, width: int = 1, precision: str = "fp32") -> None:
        if precision == "bf16":
            raise ValueError(f"precision={precision!r} is not supported by this engine")


class _StrictPlugin(_FakePlugin):
    """A registered third-party plugin whose engine refuses bf16 (only its constructor runs)."""

    config_factory = _RejectsBf16Config

    def __init__(self, width: int = 1, precision: str = "fp32") -> None:  # type: ignore[override]
        self.config = config_from_arguments(_RejectsBf16Config, locals())

    def supported_precisions(self) -> list[str]:
        return ["fp32"]


def test_the_precision_the_trainer_passes_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PLUGINS, "strict", _StrictPlugin)
    config = load_config(None, ["plugin=strict", "mixed_precision=bf16"])
    for check in (check_plugin_values, build_plugin):
        with pytest.raises(ConfigError) as info:
            check(config)
        assert info.value.key == "mixed_precision"
        assert "mixed_precision = 'bf16' was rejected by _StrictPlugin" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["plugin=low_level_zero", "plugin_kwargs.stage=5"], "plugin_kwargs.stage"),
        ([*HYBRID, "plugin_kwargs.zero_stage=5"], "plugin_kwargs.zero_stage"),
        ([*HYBRID, "plugin_kwargs.enable_sequence_parallelism=True"],
         "plugin_kwargs.enable_sequence_parallelism"),
    ],
)  # fmt: skip
def test_the_rejected_keyword_is_named(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_plugin_values(load_config(None, overrides))
    assert info.value.key == key
