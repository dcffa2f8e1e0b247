"""The legacy-engine tutorial examples (``examples/legacy/``) run under ``kolossos run`` on 2
processes, as a user starts them, and show what their tutorial page promises.

Each test starts ``python -m kolossos.cli.main run --nproc_per_node 2 examples/legacy/<name>/
train.py --config <config>`` in a subprocess (one thread per rank, synthetic data, a free master
port), then checks the exit code (each script checks its own claim at full precision) and the
lines it printed.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "legacy"
TIMEOUT_S = 900  # only detects a hang (a run takes ~5-10 s): tests never gate on speed
FLOAT = r"[-+]?\d+\.\d+(?:e[-+]?\d+)?"


def run_legacy_example(name: str, config: str, tmp_path: Path, nproc: int = 2) -> str:
    """Run ``examples/legacy/<name>/train.py --config <config>`` on ``nproc`` local processes;
    return its output (stdout and stderr) after checking the exit code."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DATA=str(tmp_path / "data"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    folder = EXAMPLES / name
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", str(nproc)]
    argv += ["--master_port", str(free_port()), str(folder / "train.py")]
    argv += ["--config", str(folder / config)]
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}"
    return done.stdout


def epoch_losses(out: str) -> list[float]:
    """The ``epoch i: mean loss x`` values rank 0 logged, in order."""
    found = re.findall(rf"\[rank 0\] epoch (\d+): mean loss ({FLOAT}|nan|inf)", out)
    assert [int(i) for i, _ in found] == list(range(len(found))), out
    return [float(x) for _, x in found]


@rerun_if_address_is_in_use()
def test_gradient_accumulation_example(tmp_path: Path) -> None:
    out = run_legacy_example("gradient_accumulation", "config.py", tmp_path)
    found = re.findall(
        r"^iteration (\d+), first 10 elements of param: tensor\(\[([^\]]*)\]\)", out, re.M
    )
    assert [int(i) for i, _ in found] == [0, 1, 2, 3], out  # printed once, by rank 0
    values = [[float(v) for v in text.split(",")] for _, text in found]
    assert all(len(v) == 10 for v in values)
    assert values[0] == values[1] == values[2] != values[3]  # updated at the 4th iteration only
    assert "The parameter is only updated in the last iteration" in out


@rerun_if_address_is_in_use()
def test_gradient_clipping_example(tmp_path: Path) -> None:
    out = run_legacy_example("gradient_clipping", "config.py", tmp_path)
    norms = re.findall(rf"grad norm before clipping ({FLOAT}), after clipping ({FLOAT})", out)
    assert len(norms) == 3, out  # STEPS_PER_EPOCH iterations, logged by rank 0
    for before, after in ((float(b), float(a)) for b, a in norms):
        assert before > 1.0  # clipping had work to do
        assert 0.99 <= after <= 1.0 + 1e-4  # clipped to clip_grad_norm = 1.0


@rerun_if_address_is_in_use()
def test_gradient_handler_example(tmp_path: Path) -> None:
    out = run_legacy_example("gradient_handler", "config.py", tmp_path)
    assert "gradient handlers: ['DataParallelGradientHandler', 'MyGradientHandler']" in out
    assert "torch DDP used: False" in out
    calls = re.findall(
        r"MyGradientHandler call (\d+): gradients identical on all 2 data-parallel ranks: (\w+)",
        out,
    )
    assert calls == [("1", "True"), ("2", "True"), ("3", "True")], out
    assert "parameters identical on all data-parallel ranks: True" in out


@rerun_if_address_is_in_use()
@pytest.mark.parametrize("mode", ["torch", "naive", "apex"])
def test_amp_example(mode: str, tmp_path: Path) -> None:
    out = run_legacy_example("amp", f"config_{mode}.py", tmp_path)
    assert f"AMP mode: AMP_TYPE.{mode.upper()}" in out
    losses = epoch_losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), out
    assert losses[-1] < losses[0] - 0.1, losses  # trains (~4.58 -> ~4.33 on the synthetic data)


@rerun_if_address_is_in_use()
def test_quick_preview_example(tmp_path: Path) -> None:
    out = run_legacy_example("quick_preview", "config.py", tmp_path)
    for rank in (0, 1):  # each rank holds half of each weight (HIDDEN_FEATURES = 256)
        assert (
            f"rank {rank} parameter shapes: {{'linear_1.weight': (128, 64), 'linear_1.bias': "
            "(128,), 'linear_2.weight': (64, 128), 'linear_2.bias': (64,)}"
        ) in out
    losses = epoch_losses(out)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), out
    assert losses[-1] < 0.5 * losses[0], losses


def test_quick_preview_example_2d(tmp_path: Path) -> None:
    """The README's ``MLP_2D`` of ``Linear2D`` on 4 processes: each rank holds one (in/2, out/2)
    block of each weight; the loss (the ranks' shares summed) falls as in the 1D run."""
    out = run_legacy_example("quick_preview", "config_2d.py", tmp_path, nproc=4)
    for rank in range(4):
        assert (
            f"rank {rank} parameter shapes: {{'linear_1.weight': (32, 128), 'linear_1.bias': "
            "(64,), 'linear_2.weight': (128, 32), 'linear_2.bias': (16,)}"
        ) in out
    losses = epoch_losses(out)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), out
    assert losses[-1] < 0.5 * losses[0], losses
