"""``kolossos train`` as a user runs it, in subprocesses: a config error reported before anything
starts; a real 2-process job stopped by Ctrl-C (SIGINT to its process group) mid-run, which exits
cleanly with the resume command and leaves the last checkpoint intact and loadable; and that
command, which finishes the run and writes every output."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
HANG_S = 900  # subprocess limits only detect hangs: tests never gate on speed
TINY = """\
name = "tiny"
[model]
n_layer = 1
n_embd = 32
n_head = 2
block_size = 32
[train]
steps = {steps}
batch_size = 8
warmup_steps = 2
eval_interval = 10
eval_batches = 1
log_interval = 5
[checkpoint]
every = {every}
keep_last = 2
[sample]
tokens = 16
"""


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kolossos.cli.train", *args]


def job_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def write_config(folder: Path, steps: int, every: int) -> Path:
    path = folder / "tiny.toml"
    path.write_text(TINY.format(steps=steps, every=every))
    return path


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["train.batch_size=7"], ["train.batch_size = 7", "multiples of 2"]),
        # these used to fail only inside the launched workers, seconds later, as tracebacks
        (["data.path=missing.txt"], ["data.path = 'missing.txt'", "does not exist"]),
        (["plugin_kwargs.bucket_cap_mb=abc"], ["plugin_kwargs.bucket_cap_mb = 'abc'"]),
        (["sample.prompt=\u20ac"], ["sample.prompt", "cannot encode"]),
        (["--master_port", "70000"], ["--master_port 70000", "1..65535"]),
        (["--resume"], ["no complete checkpoint", "--resume=auto"]),
        pytest.param(
            ["metrics.tensorboard=true"],
            ["metrics.tensorboard", "pip install tensorboard"],
            marks=pytest.mark.skipif(
                importlib.util.find_spec("tensorboard") is not None,
                reason="tensorboard is installed: nothing to refuse",
            ),
        ),
    ],
    ids=["batch", "corpus", "plugin-value", "prompt", "port", "resume", "tensorboard"],
)
def test_config_error_starts_nothing(tmp_path: Path, args: list[str], needles: list[str]) -> None:
    done = subprocess.run(
        command(*args, f"output_dir={tmp_path / 'runs'}"),
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kolossos train: error: "), done.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def read_until(proc: subprocess.Popen[str], needle: str, seen: list[str], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"{needle!r} never appeared:\n{''.join(seen)}")


def check_outputs(run: Path, steps: int) -> None:
    for name in ("config.json", "metrics.jsonl", "loss.png", "sample.txt", "summary.json"):
        assert (run / name).stat().st_size > 0, name
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(kept) == 2 and kept[-1] == f"step_{steps:06d}", kept  # keep_last = 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["final_val_perplexity"] == pytest.approx(math.exp(summary["final_val_loss"]))
    assert len(summary["peak_mem_bytes"]) == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == list(range(1, steps + 1))  # the interrupted tail was dropped


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_resume_finishes(tmp_path: Path) -> None:
    from kolossos.checkpoint_io import GeneralCheckpointIO
    from kolossos.train.config import ModelSection
    from kolossos.train.model import build_model

    config = write_config(tmp_path, steps=100_000, every=5)
    argv = command(str(config), f"output_dir={tmp_path / 'runs'}")
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        read_until(proc, "saved checkpoint", seen, limit_s=HANG_S)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, _ = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(seen) + out
    assert proc.returncode == 130, text
    assert "resume with:" in text and "--resume" in text, text
    assert "SignalException" not in text and "Traceback" not in text, text
    resume_line = text.split("resume with:")[1].strip().splitlines()[0]
    assert resume_line.startswith("kolossos train ") and resume_line.endswith(" --resume")

    run = tmp_path / "runs" / "tiny" / "checkpoints"
    kept = sorted(p for p in run.iterdir() if p.name.startswith("step_"))
    assert kept and not [p for p in run.iterdir() if p.name.startswith(".")]
    last = kept[-1]
    assert f"checkpoint is {last}" in text
    model = build_model(ModelSection(n_layer=1, n_embd=32, n_head=2, block_size=32), 76)
    assert GeneralCheckpointIO().load_model(model, last / "model").ok

    step = int(last.name.split("_")[1])  # resume, now with an end in sight
    done = subprocess.run(
        [*argv, f"train.steps={step + 3}", "--resume"],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from {last}" in done.stdout and f"finished {step + 3} steps" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    check_outputs(tmp_path / "runs" / "tiny", step + 3)
